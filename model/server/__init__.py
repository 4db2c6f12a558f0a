"""The OpenAI-compatible HTTP server (tools/serve.py): `protocol` (request schemas, validation, error
bodies), `text` (incremental detokenization, stop strings), `loop` (the one engine-loop thread),
`metrics` (Prometheus), `app` (FastAPI routes), `engines` (engine= key), `runner` (uvicorn + drain)."""
