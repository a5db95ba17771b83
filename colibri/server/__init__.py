"""`colibri serve`: an OpenAI-compatible HTTP server over the batched engine (docs/SERVER.md)."""
