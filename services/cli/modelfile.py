"""A Modelfile read as Ollama's own command line reads it for ``ollama create -f``: the
instructions become the fields of Ollama's ``/api/create`` (`schemas.work.ModelChange`).
Pure: no I/O.

Instructions are case-insensitive, one per line: ``FROM``, ``SYSTEM``, ``TEMPLATE``,
``PARAMETER <name> <value>`` (again for each ``stop``), ``MESSAGE <role> <text>``,
``LICENSE``; a value runs to the end of its line, or is quoted (``"…"``, or ``\"\"\"…\"\"\"`` over
several lines). ``#`` starts a comment line. ``FROM`` names a model: a file (a GGUF or a
Safetensors directory) would have to be uploaded to each machine first, and ``ADAPTER`` too;
both are refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Final, cast, get_args

from schemas.work import ChatMessage, ChatRole, ModelChange
from services.errors import BadRequest

_INSTRUCTION: Final = re.compile(r"\s*([A-Za-z]+)\s*(.*)", re.DOTALL)
_ROLES: Final = frozenset(get_args(ChatRole))
# Parameters Ollama keeps as lists (every other one takes its last value).
_LISTS: Final = frozenset({"stop"})


def _values(text: str) -> list[tuple[int, str, str]]:
    """(line number, instruction, its raw value) for each instruction in ``text``."""
    found: list[tuple[int, str, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        number = i + 1
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _INSTRUCTION.fullmatch(line)
        if match is None:
            raise BadRequest(f"Modelfile line {number}: expected an instruction, got {line!r}")
        name, rest = match.group(1).upper(), match.group(2)
        if '"""' in rest:
            head, _, tail = rest.partition('"""')
            body = [tail]
            while '"""' not in body[-1]:
                if i >= len(lines):
                    raise BadRequest(f'Modelfile line {number}: unterminated """')
                body.append(lines[i])
                i += 1
            joined = "\n".join(body)
            rest = head + joined[: joined.index('"""')]
        found.append((number, name, rest.strip()))
    return found


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _typed(value: str) -> Any:
    """A parameter's value as Ollama's client sends it: a number or a boolean when it is one."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def parse_modelfile(text: str) -> ModelChange:
    """The ``create`` change a Modelfile describes; `BadRequest` naming the line otherwise."""
    source: str | None = None
    system: str | None = None
    template: str | None = None
    licenses: list[str] = []
    parameters: dict[str, Any] = {}
    messages: list[ChatMessage] = []
    for number, name, raw in _values(text):
        value = _unquote(raw)
        where = f"Modelfile line {number}"
        match name:
            case "FROM":
                if value.startswith((".", "/", "~")) or value.endswith((".gguf", ".bin")):
                    raise BadRequest(
                        f"{where}: FROM {value} is a file; create from a model the machines "
                        "have (pull it first), files are not carried to them"
                    )
                source = value
            case "SYSTEM":
                system = value
            case "TEMPLATE":
                template = value
            case "LICENSE":
                licenses.append(value)
            case "PARAMETER":
                key, _, setting = raw.partition(" ")
                if not key or not setting.strip():
                    raise BadRequest(f"{where}: PARAMETER needs a name and a value")
                typed = _typed(_unquote(setting.strip()))
                if key in _LISTS:
                    parameters.setdefault(key, []).append(str(typed))
                else:
                    parameters[key] = typed
            case "MESSAGE":
                role, _, content = raw.partition(" ")
                if role not in _ROLES:
                    raise BadRequest(
                        f"{where}: MESSAGE role must be one of {', '.join(sorted(_ROLES))}"
                    )
                text = _unquote(content.strip())
                messages.append(ChatMessage(role=cast(ChatRole, role), content=text))
            case "ADAPTER":
                raise BadRequest(f"{where}: ADAPTER files are not carried to the machines")
            case _:
                raise BadRequest(f"{where}: unknown instruction {name}")
    if source is None:
        raise BadRequest("the Modelfile has no FROM: name the model it starts from")
    return ModelChange(
        op="create",
        source=source,
        system=system,
        template=template,
        parameters=parameters or None,
        messages=messages or None,
        license=licenses or None,
    )
