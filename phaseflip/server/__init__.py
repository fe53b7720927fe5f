"""HTTP server: OpenAI-compatible and native endpoints over the engine."""
