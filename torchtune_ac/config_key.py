"""How a config key is declared, once: a dataclass field whose annotation is the key's type, whose default is its
default, and whose metadata holds what it means (``doc``) and what validation checks.

Every group of keys is such a dataclass: the recipe's schema (``config/schema.py``) and the groups it composes,
each beside the subsystem that uses it (``ACConfig``, ``MemoryConfig``, ``FSDPConfig``). A reference of every key
can be generated from the fields alone (``config_keys`` walks them), so a key's meaning is written here and
nowhere else.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Iterator

# What ``config/validation.py`` reads from a field's metadata (see its docstring), and ``torchtune``: torchtune's
# name for the key ("same" when it has the same name and meaning; ``tune migrate`` reads it).
CHECKS = ("minimum", "maximum", "exclusive_minimum", "exclusive_maximum", "non_empty", "positional", "recipe_kwargs", "partial", "flatten",
          "torchtune")


def config_key(default: Any = MISSING, *, doc: str, default_factory: Any = MISSING, **checks: Any) -> Any:
    """A schema field for one config key (a group of keys, with ``flatten`` or a dataclass type).

    Args:
        default: the key's default; with neither it nor ``default_factory`` the key is required.
        doc: what the key means, for a reader of the reference (one or two sentences, no type or default: those are
            the field's own).
        default_factory: as ``dataclasses.field``'s (a group's defaults).
        checks: what validation applies, by ``CHECKS`` name.

    Raises:
        TypeError: a check of another name (a typo would silently check nothing).
    """
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise TypeError(f"config_key: unknown checks {unknown}; known: {', '.join(CHECKS)}")
    if not doc.strip():
        raise TypeError("config_key: every key says what it means (doc)")
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"doc": doc, **checks})


@dataclass(frozen=True)
class KeyInfo:
    """One key of a schema as a reference shows it: its dotted name, type, default and meaning."""

    name: str
    type: Any
    default: Any  # ``MISSING`` for a required key; a group's keys are listed on their own
    doc: str


def is_key_group(tp: Any) -> bool:
    """Whether ``tp`` is a group of config keys (a dataclass of ``config_key`` fields), as opposed to a value that is
    a dataclass itself (a ``_component_`` node)."""
    return dataclasses.is_dataclass(tp) and all("doc" in f.metadata for f in dataclasses.fields(tp) if f.init)


def config_keys(schema: type, prefix: str = "") -> Iterator[KeyInfo]:
    """Every key of ``schema`` in field order: a flattened group's keys at this level, a nested group's under its
    name (``fsdp.cpu_offload``)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if not f.init:
            continue
        tp = hints[f.name]
        if f.metadata.get("flatten"):
            yield from config_keys(tp, prefix)
        elif is_key_group(tp):
            yield from config_keys(tp, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not MISSING else (
                f.default_factory() if f.default_factory is not MISSING else MISSING)
            yield KeyInfo(f"{prefix}{f.name}", tp, default, f.metadata.get("doc", ""))
