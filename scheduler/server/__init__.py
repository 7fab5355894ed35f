"""`mlxsched serve`: an OpenAI-compatible HTTP server over `AsyncEngine` (a surface: it imports the engine, the
core never imports it). Modules: protocol (request bodies, error shape), messages (OpenAI messages and media ->
engine request), generation (sampling params, a choice's text deltas), stops (streaming-safe stop strings),
detokenize (incremental detokenizer), metrics (event-fed Prometheus metrics), app (the FastAPI routes), serve
(uvicorn, shutdown)."""
