"""The HTTP gateway: the fleet as one Ollama- and OpenAI-compatible endpoint."""
