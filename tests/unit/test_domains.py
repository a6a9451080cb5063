"""The domain heuristic: what a prompt without a domain is counted as."""

from __future__ import annotations

import pytest

from services.fleet.domains import DOMAINS, classify_domain

CASES = [
    # code: constructs, fences, languages and programming words, in any language
    ("Write a Python function that reverses a string.", "code"),
    ("def add(a, b):\n    return a + b\nWhy does this fail?", "code"),
    ("```\nSELECT name FROM users;\n```", "code"),
    ("What does `const f = x => x * 2` do?", "code"),
    ("Explain this traceback: KeyError 'id'", "code"),
    ("How do templates work in C++?", "code"),
    ("Pythonでリストをソートする関数を書いて", "code"),
    ("このコードのバグを直して", "code"),
    # math: arithmetic between numbers, or a mathematical word
    ("What is 17*23?", "math"),
    ("1+1は？", "math"),
    ("１＋１は？", "math"),
    ("Solve x^2 = 4", "math"),
    ("What is the probability of two sixes?", "math"),
    ("この方程式を解いてください", "math"),
    # japanese: kana, when it is neither code nor math
    ("日本の首都はどこですか？", "japanese"),
    ("カタカナで書いてください", "japanese"),
    # general: everything else; dates and ranges are not arithmetic
    ("Name three primary colours.", "general"),
    ("The meeting is on 2024-06-01 at 10:00.", "general"),
    ("Open from 9/1 to 9/30.", "general"),
    ("None of the above, thanks.", "general"),
    ("北京是中国的首都吗", "general"),  # kanji alone may be Chinese
    ("", "general"),
]


@pytest.mark.parametrize(("prompt", "domain"), CASES)
def test_a_prompt_gets_its_domain(prompt: str, domain: str) -> None:
    assert classify_domain(prompt) == domain


def test_every_answer_is_a_known_domain() -> None:
    assert {classify_domain(prompt) for prompt, _ in CASES} == set(DOMAINS)
