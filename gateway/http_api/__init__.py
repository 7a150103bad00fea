"""The OpenAI-compatible HTTP API: routes, request bodies parsed into typed requests, responses and SSE, errors."""
