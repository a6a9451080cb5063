"""What tests and benchmarks both run against, and nothing in production imports.

``servers``: a real nats-server (the pinned wheel) and a real PostgreSQL per run; ``fakes``:
HTTP stand-ins for outside services (Ollama, SearXNG), real sockets with fake behaviour,
runnable on their own (``python -m devtools.fakes.ollama --port 11434``).
"""
