"""The HTTP edge: body and header limits, API key, CORS, drain on SIGTERM, SSE framing, errors in
OpenAI's shape, and the OpenAPI schema. Nothing here knows about models or generation."""
