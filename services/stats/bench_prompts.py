"""The bench's prompts (pure): the built-in set and a prompt file's text read into prompts.

Reading the file is the job's (`bench.load_prompts`); this module only turns its text into
`BenchPrompt`s, so a bad file is refused with the same messages wherever the text comes from.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from services.errors import ConfigError
from services.fleet.domains import classify_domain


@dataclass(frozen=True)
class BenchPrompt:
    name: str
    domain: str
    prompt: str

    @property
    def key(self) -> str:
        """Results are compared with earlier results of the same prompt text."""
        return hashlib.sha256(self.prompt.encode()).hexdigest()[:16]


BUILTIN_PROMPTS: Final = (
    BenchPrompt(
        "code-fib",
        "code",
        "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    ),
    BenchPrompt("math-product", "math", "What is 17*23? Answer with the number only."),
    BenchPrompt("japanese-capital", "japanese", "日本の首都はどこですか？一文で答えてください。"),
    BenchPrompt("general-colours", "general", "Name the three primary colours of light."),
)


class _PromptFileEntry(msgspec.Struct, forbid_unknown_fields=True):
    prompt: str
    name: str | None = None
    domain: str | None = None


def parse_prompts(path: Path, text: str) -> list[BenchPrompt]:
    """Prompts from the text of the file ``path``: a ``.json`` list (of strings, or of
    ``{"prompt", "name"?, "domain"?}``), else one prompt per non-blank line (``#`` starts a
    comment line).

    ``path`` only names the file in messages and tells JSON by its suffix. A missing domain is
    the heuristic's. Raises `ConfigError` naming what is wrong.
    """
    entries: list[_PromptFileEntry]
    if path.suffix.lower() == ".json":
        try:
            raw = json.loads(text)
            if not isinstance(raw, list):
                raise ConfigError(f"--prompts {path}: expected a JSON list of prompts")
            entries = [
                _PromptFileEntry(prompt=item)
                if isinstance(item, str)
                else msgspec.convert(item, _PromptFileEntry)
                for item in raw
            ]
        except (ValueError, msgspec.ValidationError) as exc:
            raise ConfigError(f"--prompts {path}: {exc}") from None
    else:
        lines = [line.strip() for line in text.splitlines()]
        entries = [_PromptFileEntry(prompt=line) for line in lines if line and line[0] != "#"]
    prompts = []
    for number, entry in enumerate(entries, start=1):
        if not entry.prompt.strip():
            raise ConfigError(f"--prompts {path}: prompt {number} is empty")
        prompts.append(
            BenchPrompt(
                name=entry.name or f"prompt-{number}",
                domain=entry.domain or classify_domain(entry.prompt),
                prompt=entry.prompt,
            )
        )
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts in the file")
    return prompts
