"""LLM-as-judge, the pure part: one rubric per domain, the judge's prompt, and reading its verdict.

The judge is asked to answer with a line ``SCORE: <number from 0 to 1>``. Models do not always
obey, so `parse_verdict` reads what they actually write, within limits:

- a labelled score anywhere in the text: ``SCORE: 0.8``, ``Score = .8``, ``**Score:** 0.8``,
  ``"score": 0.8`` (JSON), ``score is 0.8``;
- on a stated scale: ``8/10``, ``4 / 5``, ``80%``, ``SCORE: 8 out of 10``;
- or a reply that is nothing but a number from 0 to 1 (``0.75``).

Anything else is **malformed**, not guessed: no score at all, a bare number above 1 with no
scale (is ``8`` out of 10 or of 100?), a score outside 0–1, or labelled scores that disagree.
Reasoning inside ``<think>…</think>`` is ignored, so a model that thinks aloud about "a score
of 0.3, or maybe 0.9" is judged by its answer only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

RUBRICS: Final[dict[str, str]] = {
    "code": (
        "Is the code correct, would it run as given, does it do what was asked, and is it "
        "reasonably idiomatic and explained?"
    ),
    "math": (
        "Is the final answer correct? Is the reasoning valid and free of calculation errors? "
        "A wrong final answer scores 0.2 or less, whatever the working."
    ),
    "japanese": (
        "Does it answer in natural, correct Japanese (unless asked otherwise), is the content "
        "accurate, and does it answer what was asked?"
    ),
    "general": (
        "Is the answer accurate, relevant to the question, complete enough, and clearly "
        "written? Does it avoid making things up?"
    ),
}

# How much of the task the judge sees: enough to judge, bounded for small judge models.
MAX_PROMPT_CHARS: Final = 4000
MAX_RESPONSE_CHARS: Final = 8000

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL | re.IGNORECASE)
_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_SCALE = rf"(?:\s*(%)|\s*(?:/|out\s+of)\s*{_NUMBER})?"
_LABELLED = re.compile(
    rf"""\bscore\b["'*\s]*(?:[:=]|\bis\b|\bof\b)?["'*\s]*{_NUMBER}{_SCALE}""",
    re.IGNORECASE,
)
_BARE = re.compile(rf"^\s*[*\s]*{_NUMBER}{_SCALE}[*\s.]*$")


@dataclass(frozen=True, slots=True)
class Verdict:
    """A score from 0 to 1, or why the judge's text gives none."""

    score: float | None
    malformed: str | None = None

    @property
    def ok(self) -> bool:
        return self.score is not None


def rubric_for(domain: str | None) -> tuple[str, str]:
    """``(name, rubric)`` for a domain; an unknown or missing domain gets the general one."""
    name = domain if domain in RUBRICS else "general"
    return name, RUBRICS[name]


def judge_prompt(prompt: str, response: str, domain: str | None) -> tuple[str, str]:
    """``(rubric name, prompt for the judge)`` for one task's prompt and response."""
    name, rubric = rubric_for(domain)
    text = (
        "You are a strict, fair judge of answers given by an AI assistant.\n"
        f"Criteria ({name}): {rubric}\n\n"
        "<question>\n"
        f"{_clip(prompt, MAX_PROMPT_CHARS)}\n"
        "</question>\n\n"
        "<answer>\n"
        f"{_clip(response, MAX_RESPONSE_CHARS)}\n"
        "</answer>\n\n"
        "Rate the answer from 0 (useless or wrong) to 1 (excellent). Reply with exactly one "
        "line 'SCORE: <number from 0 to 1>', then one sentence saying why."
    )
    return name, text


def parse_verdict(text: str) -> Verdict:
    """The score the judge's ``text`` states, or a malformed verdict saying what is wrong."""
    answer = _THINK.sub(" ", text)
    labelled = list(_LABELLED.finditer(answer))
    if labelled:
        values: list[float] = []
        for match in labelled:
            value, problem = _value(match.group(1), match.group(2), match.group(3))
            if problem is not None:
                return Verdict(None, f"{problem} in {match.group(0).strip()!r}")
            assert value is not None
            values.append(value)
        if max(values) - min(values) > 1e-9:
            shown = ", ".join(f"{v:g}" for v in values)
            return Verdict(None, f"the judge gave conflicting scores ({shown})")
        return Verdict(values[0])
    bare = _BARE.match(answer)
    if bare is not None:
        value, problem = _value(bare.group(1), bare.group(2), bare.group(3))
        if problem is not None:
            return Verdict(None, f"{problem} in {answer.strip()!r}")
        return Verdict(value)
    if not answer.strip():
        return Verdict(None, "the judge's reply is empty")
    return Verdict(None, "no score found in the judge's reply")


def _value(number: str, percent: str | None, scale: str | None) -> tuple[float | None, str | None]:
    """A number with its optional scale as 0–1, or what is wrong with it."""
    value = float(number)
    if percent:
        value /= 100
    elif scale is not None:
        denominator = float(scale)
        if denominator <= 0:
            return None, "a score on a scale of 0"
        value /= denominator
    elif value > 1:
        return None, f"a score of {number} with no scale (0–1 was asked)"
    if not 0 <= value <= 1:
        return None, f"a score outside 0–1 ({value:g})"
    return value, None


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[… {len(text) - limit} more characters not shown]"
