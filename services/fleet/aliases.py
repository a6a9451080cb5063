"""Model aliases (lesson 6): several names, one statistics key. Pure functions.

An alias maps a name to another (``AliasSet(alias, canonical)``); chains are followed, so
``hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M → elyza-jp-8b`` and later ``elyza-jp-8b →
elyza:8b`` key both under ``elyza:8b``. A change that would close a cycle is refused
(`check_alias`); a cycle in the log anyway (two operators racing) resolves to the first name
met twice instead of looping.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.errors import BadRequest


def resolve(aliases: Mapping[str, str], name: str) -> str:
    """The canonical name for ``name``: its alias chain followed to the end."""
    seen = {name}
    while name in aliases:
        name = aliases[name]
        if name in seen:
            break
        seen.add(name)
    return name


def check_alias(aliases: Mapping[str, str], alias: str, canonical: str) -> None:
    """Raise `BadRequest` unless ``alias → canonical`` can be added to ``aliases``."""
    if not alias.strip() or not canonical.strip():
        raise BadRequest("alias and canonical name must not be empty")
    if alias == canonical:
        raise BadRequest(f"'{alias}' cannot be an alias of itself")
    changed = {**aliases, alias: canonical}
    name, seen = canonical, {alias}
    while name in changed and name not in seen:
        seen.add(name)
        name = changed[name]
    if name == alias:
        raise BadRequest(
            f"'{canonical}' leads back to '{alias}'; making '{alias}' an alias of it would "
            "close a cycle"
        )
