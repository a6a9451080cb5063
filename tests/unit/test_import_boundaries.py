"""Who may import whom: services do not import each other, shared layers import no service.

Each service applies the fleet's rules from ``services.fleet`` (pure) and its plumbing from
``services.runtime``, never from another service, so a rule lives in one place and a service
can change without breaking another. ``services.cli`` is the composition root: it runs every
service, so it alone may import them all. ``services.backends`` (the model-server clients) is
shared. Benchmarks and ``devtools`` never import ``tests``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = frozenset({"router", "worker", "web_search", "reaper", "stats", "gateway", "cli"})
SHARED = frozenset({"runtime", "fleet", "backends"})
# Libraries that do I/O: the fleet's rules are pure.
IO_LIBRARIES = frozenset({"nats", "asyncpg", "httpx", "aiohttp", "structlog", "opentelemetry"})


def imported(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports (at any depth: a function's local import counts too)."""
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield node.lineno, base
            # `from services import router` names a service as well as `services.router`.
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)


def service_of(module: str) -> str | None:
    """``router`` for ``services.router.service``; None outside ``services.<package>``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "services" else None


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """What ``path`` imports that its place in the layout forbids."""
    parts = path.relative_to(root).parts
    found: list[str] = []
    for line, module in imported(path, root):
        target = service_of(module)
        top = module.split(".")[0]
        where = f"{path.relative_to(root)}:{line} imports {module}"
        if parts[0] in ("benchmarks", "devtools", "services", "schemas") and top == "tests":
            found.append(f"{where}: only tests import tests")
        if parts[0] == "schemas" and target is not None:
            found.append(f"{where}: schemas import no service code")
        if parts[0] != "services" or len(parts) < 3:
            continue
        own = parts[1]
        if own in SHARED and target in SERVICES:
            found.append(f"{where}: services/{own} is shared and imports no service")
        elif own in SERVICES - {"cli"} and target in SERVICES and target != own:
            found.append(f"{where}: a service imports no other service (move the rule to fleet)")
        if own == "fleet" and top in IO_LIBRARIES:
            found.append(f"{where}: services/fleet is pure")
    return found


def python_files() -> list[Path]:
    return sorted(
        p
        for d in ("services", "schemas", "benchmarks", "devtools")
        for p in (ROOT / d).rglob("*.py")
    )


def test_every_module_keeps_to_its_layer() -> None:
    files = python_files()
    assert any(p.parts[-3:] == ("services", "fleet", "policy.py") for p in files)
    problems = [v for p in files for v in violations(p)]
    assert problems == []


@pytest.mark.parametrize(
    ("place", "source", "allowed"),
    [
        ("services/reaper/x.py", "from services.router.policy import choose", False),
        ("services/reaper/x.py", "from services import router", False),
        ("services/reaper/x.py", "from services.fleet.policy import choose", True),
        ("services/reaper/x.py", "from services.reaper.view import ReaperView", True),
        ("services/stats/x.py", "from services.cli.client import call", False),
        ("services/stats/x.py", "from services.backends.ollama import OllamaBackend", True),
        ("services/stats/x.py", "from services.worker.backends import Backend", False),
        ("services/runtime/x.py", "from services.stats.aliases import resolve", False),
        ("services/runtime/x.py", "from services.fleet.aliases import resolve", True),
        ("services/fleet/x.py", "import nats", False),
        ("services/fleet/x.py", "from .liveness import live", True),
        ("services/fleet/x.py", "from ..router import policy", False),
        ("services/cli/x.py", "from services.router.service import run", True),
        ("benchmarks/x.py", "from tests.servers import NatsServer", False),
        ("benchmarks/x.py", "from devtools.servers import NatsServer", True),
    ],
)
def test_the_rule_itself(tmp_path: Path, place: str, source: str, allowed: bool) -> None:
    path = tmp_path / place
    path.parent.mkdir(parents=True)
    path.write_text(source + "\n")
    assert (violations(path, tmp_path) == []) is allowed
