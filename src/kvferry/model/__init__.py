"""Models, loading, attention over paged KV and sampling. Torch lives here."""
