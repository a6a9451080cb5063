"""Which model-server client a process's settings choose: one factory for every kind."""

from __future__ import annotations

from typing import Literal

from services.backends import Backend
from services.backends.ollama import OllamaBackend
from services.backends.openai import OpenAIBackend


def make_backend(
    kind: Literal["ollama", "openai"],
    *,
    ollama_host: str,
    openai_base_url: str,
    openai_api_key: str | None,
    connect_timeout_s: float,
) -> Backend:
    """Ollama's native API, or any OpenAI-compatible server (llama.cpp, vLLM, LM Studio)."""
    if kind == "openai":
        return OpenAIBackend(
            openai_base_url, api_key=openai_api_key, connect_timeout_s=connect_timeout_s
        )
    return OllamaBackend(ollama_host, connect_timeout_s=connect_timeout_s)
