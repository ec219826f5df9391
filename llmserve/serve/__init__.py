"""The OpenAI-compatible HTTP server over one `EngineClient`."""
