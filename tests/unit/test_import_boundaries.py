"""Who may import whom: the layers, lowest first, each importing only its own and those below.

1. ``schemas``: the wire types.
2. ``services.errors`` (and the package's ``__version__``): the error catalogue.
3. ``services.fleet``: the rules every service applies, pure (no I/O library).
4. ``services.backends``: the model-server clients.
5. ``services.runtime``: the plumbing every service shares.
6. Each service (router, worker, web_search, reaper, stats, gateway): never another one, so a
   rule lives in one place and a service can change without breaking another.
7. ``services.cli``: the composition root, which runs every service.

No module imports one that imports it back, at any distance (a circle of imports). Benchmarks
and ``devtools`` never import ``tests``, and the shipped code never imports either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = frozenset({"router", "worker", "web_search", "reaper", "stats", "gateway"})
# Each layer's rank: a module imports only modules of its own rank or lower (a service: its own
# package, never another at the same rank).
RANKS = {"schemas": 1, "errors": 2, "__version__": 2, "fleet": 3, "backends": 4, "runtime": 5}
SERVICE_RANK = 6
CLI_RANK = 7
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


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, name) of the layer a module belongs to; None outside the layers (a library,
    ``tests``, ``devtools``, ``benchmarks``)."""
    parts = module.split(".")
    if parts[0] == "schemas":
        return RANKS["schemas"], "schemas"
    if parts[0] != "services":
        return None
    if len(parts) == 1:
        return RANKS["__version__"], "services"
    name = parts[1]
    if name in RANKS:
        return RANKS[name], name
    if name == "cli":
        return CLI_RANK, name
    if name in SERVICES:
        return SERVICE_RANK, name
    return None


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """What ``path`` imports that its place in the layers forbids."""
    parts = path.relative_to(root).with_suffix("").parts
    own = layer_of(".".join(parts[:2]))
    found: list[str] = []
    for line, module in imported(path, root):
        top = module.split(".")[0]
        where = f"{path.relative_to(root)}:{line} imports {module}"
        if parts[0] in ("benchmarks", "devtools", "services", "schemas") and top == "tests":
            found.append(f"{where}: only tests import tests")
        if parts[0] in ("services", "schemas") and top in ("devtools", "benchmarks"):
            found.append(f"{where}: the shipped code imports no development tool")
        if own is not None and own[1] == "fleet" and top in IO_LIBRARIES:
            found.append(f"{where}: services/fleet is pure")
        target = layer_of(module)
        if own is None or target is None:
            continue
        if target[0] > own[0]:
            found.append(f"{where}: {own[1]} sits below {target[1]} (an import running up)")
        elif target[0] == own[0] == SERVICE_RANK and target[1] != own[1]:
            found.append(f"{where}: a service imports no other service (move the rule to fleet)")
    return found


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ``services`` and ``schemas`` with the modules of theirs it imports."""
    modules = {}
    for d in ("services", "schemas"):
        for path in (root / d).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, module in imported(path, root):
            target = module
            while target and target not in modules:  # an attribute: its module
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(f"{target}."):
                graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of imports: groups of modules each reachable from every other (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group: list[str] = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
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


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = module_graph()
    assert "services.cli.doctor_checks" in graph["services.cli.doctor"]
    assert circles(graph) == []


def test_a_circle_is_found_at_any_distance() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


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
        ("services/runtime/x.py", "from services.backends import OnChunk", True),
        ("services/backends/x.py", "from services.runtime.bus import connect", False),
        ("services/fleet/x.py", "from services.runtime.errors import Unavailable", False),
        ("services/fleet/x.py", "from services.errors import Unavailable", True),
        ("services/fleet/x.py", "from services.backends import OnChunk", False),
        ("services/errors.py", "from services.fleet import policy", False),
        ("services/errors.py", "from schemas.route import ErrorDetail", True),
        ("schemas/x.py", "from services.errors import Unavailable", False),
        ("services/runtime/x.py", "from services.cli.doctor import run", False),
        ("services/gateway/x.py", "from devtools.fakes.ollama import FakeOllama", False),
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
