"""HTTP server (OpenAI protocol), engine loop, metrics."""
