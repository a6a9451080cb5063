"""The summary as pure functions: which model, the prompt, the time it gets, the fallback.

The summary is a convenience on top of the search: when it fails, the task still ends done,
with the results as a plain list (`fallback_response`) and a note saying why (`fallback_note`).
"""

from __future__ import annotations

from collections.abc import Sequence

from schemas.route import DEFAULT_MODEL, Source

# Below this many seconds left in the task's budget, a summary is not attempted.
MIN_SUMMARY_S = 1.0

INSTRUCTIONS = (
    "Answer the question below from the numbered web search results that follow it, and from "
    "nothing else. After each statement, cite the results it rests on by their numbers in "
    "square brackets, like [1] or [2][3]. If the results do not answer the question, say so. "
    "Answer in the language of the question, in a few sentences."
)


def summary_model(requested: str, configured: str) -> str:
    """The request's model, unless it asks for the default (``"default"``): then the
    worker's OLLAMA_MODEL. A model the backend does not serve fails the summary, and the
    fallback's note says so; it is not silently swapped for another."""
    return configured if requested.strip() in ("", DEFAULT_MODEL) else requested


def is_served(model: str, served: Sequence[str]) -> bool:
    """Does the backend's model list hold ``model`` (a name without a tag means ``:latest``)?"""
    return model in served or (":" not in model and f"{model}:latest" in served)


def summary_prompt(question: str, sources: Sequence[Source]) -> str:
    """The prompt that asks for an answer grounded in ``sources``, citing them as ``[n]``."""
    results = "\n\n".join(
        f"[{n}] {source.title}\n{source.url}" + (f"\n{source.snippet}" if source.snippet else "")
        for n, source in enumerate(sources, start=1)
    )
    return f"{INSTRUCTIONS}\n\nQuestion: {question.strip()}\n\nResults:\n\n{results}\n\nAnswer:"


def summary_budget(*, task_timeout_s: float, elapsed_s: float, summary_timeout_s: float) -> float:
    """Seconds the summary may take: SUMMARY_TIMEOUT_S, cut to what is left of the task's own
    timeout. 0 when less than `MIN_SUMMARY_S` is left: then no summary is attempted."""
    left = task_timeout_s - elapsed_s
    return 0.0 if left < MIN_SUMMARY_S else min(summary_timeout_s, left)


def fallback_response(sources: Sequence[Source]) -> str:
    """The results as a numbered plain-text list: title, address, snippet."""
    lines: list[str] = []
    for n, source in enumerate(sources, start=1):
        lines.append(f"{n}. {source.title}")
        lines.append(f"   {source.url}")
        if source.snippet:
            lines.append(f"   {source.snippet}")
    return "\n".join(lines)


def fallback_note(code: str, reason: str) -> str:
    """What a reader of a fallback answer is told: the summary failed, and why."""
    return f"the summary failed ({code}: {reason}); the answer is the plain list of search results"
