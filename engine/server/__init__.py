"""kvfleet.engine.server: the OpenAI-compatible HTTP server (`kvfleet engine`, `kvfleet serve`)."""
