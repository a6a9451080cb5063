"""The domain of a prompt when the request names none: a small, documented heuristic.

Figures are kept per domain because the same model is fast and good at one kind of prompt and
slow or poor at another. A request may name its domain (``"domain": "code"``); when it does
not, `classify_domain` decides, from the prompt text alone, in this order (first match wins):

1. ``code``: a fenced block (```` ``` ````), a programming construct (a line starting with
   ``def``, ``class``, ``import``, ``#include``…; ``function f(``; ``print(``;
   ``SELECT … FROM``; ``=>``; ``{ … ; … }``), or a language or programming word (``Python``,
   ``JavaScript``, ``Rust``, ``SQL``, ``bash``, ``regex``, ``traceback``, ``code``, ``関数``,
   ``コード``, ``プログラム`` …).
2. ``math``: arithmetic between numbers (``17*23``, ``1+1``, ``2^10``, ``3 × 4``, ``x = 5``),
   or a mathematical word (solve, equation, integral, derivative, probability, prime, 計算,
   方程式, 微分, 積分, 確率 …). ``-`` and ``/`` between numbers do not count: they are dates.
3. ``japanese``: any hiragana or katakana (kana are Japanese only; kanji alone may be Chinese).
4. ``general``: everything else.

Code and math come before Japanese on purpose: "Pythonで関数を書いて" is a code prompt, and
"1+1は？" a math one, whatever the language. The function is pure and cheap: the router
calls it to route, the stats service to file figures.
"""

from __future__ import annotations

import re
from typing import Final

DOMAINS: Final = ("code", "math", "japanese", "general")

_FENCE = re.compile(r"```")
_CODE_CONSTRUCT = re.compile(
    r"(?m)"
    r"^\s*(def|class|import|from\s+\S+\s+import|#include|package|fn|func|public\s+class)\b"
    r"|\bdef\s+\w+\s*\("
    r"|\bfunction\s*\w*\s*\("
    r"|\bconsole\.log\b|\bprintf\s*\(|\bprint\s*\("
    r"|\bSELECT\b.+\bFROM\b"
    r"|=>"
    r"|\{[^{}]*;[^{}]*\}",
)
_CODE_WORD = re.compile(
    r"(?i)\b(python|javascript|typescript|java|rust|golang|kotlin|sql|bash|"
    r"shell script|powershell|regex|regular expression|html|css|json|yaml|dockerfile|"
    r"debug|stack trace|traceback|refactor|unit test|source code|code|algorithm)\b"
    r"|(?i:\bc\+\+|\bc#)"
    r"|関数|コード|プログラム|スクリプト|実装|デバッグ|コンパイル",
    re.ASCII,  # so that "Pythonで" still has a word boundary after "Python"
)
_ARITHMETIC = re.compile(r"\d\s*[+*×÷^＋＊=]\s*[-−]?\d|\b[a-z]\s*[=^]\s*\d|\d\s*\^\s*\w")
_MATH_WORD = re.compile(
    r"(?i)\b(solve|equation|integral|integrate|derivative|differentiate|probability|"
    r"prime|factorial|sum of|product of|square root|logarithm|matrix|theorem|proof|"
    r"calculate|compute|arithmetic|percent|fraction)\b"
    r"|計算|方程式|微分|積分|確率|素数|証明|平方根|行列",
    re.ASCII,
)
_KANA = re.compile(r"[\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f]")


def classify_domain(prompt: str) -> str:
    """The domain of ``prompt``: ``code``, ``math``, ``japanese`` or ``general``.

    See the module docstring for the rules; they are checked in that order.
    """
    if _FENCE.search(prompt) or _CODE_CONSTRUCT.search(prompt) or _CODE_WORD.search(prompt):
        return "code"
    if _ARITHMETIC.search(prompt) or _MATH_WORD.search(prompt):
        return "math"
    if _KANA.search(prompt):
        return "japanese"
    return "general"
