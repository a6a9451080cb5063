"""One line of ``coordinator doctor``: a check's name, its status and what it found (pure).

Every module of checks (`doctor_checks`, `doctor_cluster`) builds its lines from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# "warning": worth a look, but nothing is failing (the exit status stays 0).
Status = Literal["ok", "problem", "warning", "skipped"]


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str

    def line(self) -> str:
        return f"{self.status:<8} {self.name:<22} {self.detail}"


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def problem(name: str, problems: Sequence[str]) -> Check:
    """A problem, its findings joined in one line."""
    return Check(name, "problem", "; ".join(problems))


def verdict(name: str, problems: Sequence[str], fine: str) -> Check:
    """A problem when anything was found, else ok with ``fine``."""
    return problem(name, problems) if problems else ok(name, fine)
