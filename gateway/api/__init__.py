"""The OpenAI-compatible HTTP API: app factory, schemas, routes, SSE."""
