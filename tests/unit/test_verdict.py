"""Reading the judge's verdict: scores it states, never guessed ones."""

from __future__ import annotations

import pytest

from services.stats.verdict import RUBRICS, Verdict, judge_prompt, parse_verdict, rubric_for

SCORED = [
    ("SCORE: 0.8\nAccurate and clear.", 0.8),
    ("score: .75", 0.75),
    ("Score = 1", 1.0),
    ("**Score:** 0.4 - misses the second part", 0.4),
    ('{"score": 0.65, "reason": "ok"}', 0.65),
    ("The score is 0.3.", 0.3),
    ("SCORE: 8/10", 0.8),
    ("Score: 4 / 5", 0.8),
    ("Score: 7 out of 10", 0.7),
    ("SCORE: 90%", 0.9),
    ("0.7", 0.7),
    ("  1.0.  ", 1.0),
    ("8/10", 0.8),
    ("SCORE: 0.9\nA score of 0.9 is deserved.", 0.9),  # repeated, same value
    ("<think>Maybe a score of 0.2? No.</think>\nSCORE: 0.85", 0.85),
    ("SCORE: 0", 0.0),
]

MALFORMED = [
    ("I would rate it as decent overall.", "no score found in the judge's reply"),
    ("", "the judge's reply is empty"),
    ("<think>score: 0.5</think>", "the judge's reply is empty"),
    ("SCORE: 8", "a score of 8 with no scale (0–1 was asked) in 'SCORE: 8'"),
    ("7", "a score of 7 with no scale (0–1 was asked) in '7'"),
    ("Score: 12/10", "a score outside 0–1 (1.2) in 'Score: 12/10'"),
    ("Score: 150%", "a score outside 0–1 (1.5) in 'Score: 150%'"),
    ("Score: 3/0", "a score on a scale of 0 in 'Score: 3/0'"),
    ("SCORE: 0.2\nOn reflection, score: 0.9", "the judge gave conflicting scores (0.2, 0.9)"),
    ("SCORE: <number from 0 to 1>", "no score found in the judge's reply"),
]


@pytest.mark.parametrize(("text", "score"), SCORED)
def test_a_stated_score_is_read(text: str, score: float) -> None:
    assert parse_verdict(text) == Verdict(pytest.approx(score))  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "reason"), MALFORMED)
def test_a_verdict_without_a_clear_score_is_malformed_not_guessed(text: str, reason: str) -> None:
    verdict = parse_verdict(text)

    assert (verdict.score, verdict.ok, verdict.malformed) == (None, False, reason)


def test_each_domain_has_its_rubric_and_others_get_the_general_one() -> None:
    assert set(RUBRICS) == {"code", "math", "japanese", "general"}
    assert rubric_for("math") == ("math", RUBRICS["math"])
    assert rubric_for("poetry") == ("general", RUBRICS["general"])
    assert rubric_for(None) == ("general", RUBRICS["general"])


def test_the_judge_prompt_holds_question_answer_rubric_and_the_format() -> None:
    name, prompt = judge_prompt("What is 2+2?", "4", "math")

    assert name == "math"
    assert "<question>\nWhat is 2+2?\n</question>" in prompt
    assert "<answer>\n4\n</answer>" in prompt
    assert RUBRICS["math"] in prompt
    assert "SCORE: <number from 0 to 1>" in prompt
    # The instructions themselves are not a verdict.
    assert not parse_verdict(prompt).ok


def test_a_long_answer_is_clipped_for_the_judge() -> None:
    _, prompt = judge_prompt("q", "x" * 9000, "general")

    assert "[… 1000 more characters not shown]" in prompt
