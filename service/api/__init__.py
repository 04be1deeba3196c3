"""The OpenAI-compatible HTTP API: app, request/response schemas, error shapes."""
