"""OpenAI-compatible HTTP server on the paged runtime."""
