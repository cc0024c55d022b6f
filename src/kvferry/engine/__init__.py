"""Runner, engine and the offline LLM API."""
