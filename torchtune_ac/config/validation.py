"""Check a loaded config against a typed dataclass schema, collecting every problem before failing.

Written by hand rather than with OmegaConf structured configs because OmegaConf stops at the first problem
and its messages do not suggest the key the user meant; here each problem names the dotted key, the value
given and what is allowed, and all of them are reported together.

Supported field types: bool, int, float, str, ``Enum`` subclasses, ``Optional[...]``, ``list[...]``,
``dict[str, ...]``, ``Any``, nested dataclasses, and ``Component`` (a ``_component_`` node). Per-field
metadata: ``minimum`` and ``maximum`` (inclusive), ``exclusive_minimum`` and ``exclusive_maximum``, ``non_empty``
(a string with more than blanks), ``positional`` (how many positional arguments the recipe passes when
instantiating a component), ``recipe_kwargs`` (names the recipe passes itself) and
``flatten`` (a nested dataclass whose keys sit at the parent's level). A dataclass with a ``from_config(mapping)``
classmethod validates itself: it raises a ``UserError`` whose ``problems`` lists each problem.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import re
import types
import typing
from typing import Any, Collection, Iterator, Mapping, Optional, Sequence, TypeVar

from omegaconf import DictConfig, OmegaConf

from torchtune_ac.config.components import Component, parse_component
from torchtune_ac.errors import UserError

T = TypeVar("T")
_MISSING = object()


COMMAND_LINE = "command line"
# The top-level mapping of the user's own variables, read only through interpolation (``max_seq_len:
# ${vars.seq}``): no recipe reads it, so its keys are not checked; every other key still is.
USER_VARS_KEY = "vars"


class ConfigError(UserError):
    """One or more problems in a config; ``problems`` lists them, the message shows them all.

    Each problem is introduced by where its value came from: ``source`` (the YAML file), or the command line for
    the problems whose index is in ``from_command_line``.
    """

    def __init__(self, source: str, problems: Sequence[str], from_command_line: Collection[int] = ()) -> None:
        self.problems = list(problems)
        origins = {COMMAND_LINE if i in from_command_line else source for i in range(len(self.problems))}
        header = origins.pop() if len(origins) == 1 else source
        if len(self.problems) == 1:
            message = f"{header}: {self.problems[0]}"
        else:
            mark = [f"{COMMAND_LINE}: " if header != COMMAND_LINE and i in from_command_line else ""
                    for i in range(len(self.problems))]
            lines = "\n".join(f"  - {m}{p}" for m, p in zip(mark, self.problems))
            message = f"{header}: {len(self.problems)} problems:\n{lines}"
        super().__init__(message)


_PROBLEM_KEY = re.compile(r"[A-Za-z_][\w.\[\]]*")


def _set_on_command_line(problem: str, overrides: Sequence[str]) -> bool:
    """Whether ``problem`` (which starts with the dotted key it is about) is about a key an override set.

    An unknown key is the command line's too when an override set a key inside it: ``optimzer.lr=1e-4`` (or
    ``+foo.bar=1``) makes the unknown group ``optimzer`` that the YAML never had.
    """
    match = _PROBLEM_KEY.match(problem)
    if match is None:
        return False
    key = match.group(0)
    unknown = problem[match.end():].startswith(": unknown key")
    for override in overrides:
        name = override.lstrip("+~").split("=", 1)[0].split("@", 1)[0]
        if key == name or key.startswith((f"{name}.", f"{name}[")):
            return True
        if unknown and name.startswith((f"{key}.", f"{key}[")):
            return True
    return False


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = " or ".join(_type_name(a) for a in args)
        return f"{inner} or null" if len(args) < len(typing.get_args(tp)) else inner
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(str(m.value) for m in tp)
    if tp is Component:
        return "a mapping with _component_"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


class _Checker:
    def __init__(self, extra_allowed: Sequence[str]) -> None:
        self.problems: list[str] = []
        self.extra_allowed = tuple(extra_allowed)

    def fail(self, message: str) -> Any:
        self.problems.append(message)
        return _MISSING

    def check(self, value: Any, tp: Any, key: str, meta: Mapping[str, Any]) -> Any:
        origin = typing.get_origin(tp)
        if tp is Any:
            return value
        if origin in (typing.Union, types.UnionType):
            args = typing.get_args(tp)
            if value is None:
                return None if type(None) in args else self.fail(f"{key}: must not be null")
            non_none = [a for a in args if a is not type(None)]
            if len(non_none) == 1:
                return self.check(value, non_none[0], key, meta)
            for arg in non_none:
                probe = _Checker(self.extra_allowed)
                result = probe.check(value, arg, key, meta)
                if not probe.problems:
                    return result
            return self.fail(f"{key}={_show(value)}: expected {_type_name(tp)}")
        if value is None:
            return self.fail(f"{key}: must not be null (expected {_type_name(tp)})")
        if tp is Component:
            return self.check_component(value, key, meta)
        if dataclasses.is_dataclass(tp):
            return self.check_dataclass(value, tp, key)
        if origin is list:
            if not isinstance(value, list):
                return self.fail(f"{key}={_show(value)}: expected {_type_name(tp)}")
            (item_tp,) = typing.get_args(tp)
            # A list of components (GRPO's rewards) checks each item as the field says; other items have no checks.
            item_meta = meta if item_tp is Component else {}
            items = [self.check(v, item_tp, f"{key}[{i}]", item_meta) for i, v in enumerate(value)]
            return items if _MISSING not in items else _MISSING
        if origin is dict:
            if not isinstance(value, Mapping):
                return self.fail(f"{key}={_show(value)}: expected a mapping")
            _, value_tp = typing.get_args(tp)
            return {k: self.check(v, value_tp, f"{key}.{k}", {}) for k, v in value.items()}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            if isinstance(value, str):
                for member in tp:
                    if str(member.value).lower() == value.lower():
                        return member
            return self.fail(f"{key}={_show(value)}: expected {_type_name(tp)}")
        return self.check_scalar(value, tp, key, meta)

    def check_scalar(self, value: Any, tp: type, key: str, meta: Mapping[str, Any]) -> Any:
        if tp is bool:
            ok = isinstance(value, bool)
        elif tp is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif tp is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif tp is str:
            ok = isinstance(value, str)
        else:
            raise TypeError(f"unsupported schema type {tp!r} for {key}")
        if not ok:
            return self.fail(f"{key}={_show(value)}: expected {_type_name(tp)}")
        if tp is str and meta.get("non_empty") and not value.strip():
            return self.fail(f"{key}={_show(value)}: must not be empty")
        if tp is float and math.isnan(value):  # every comparison with nan is False: no bound would catch it
            return self.fail(f"{key}=nan: expected a number")
        if "minimum" in meta and value < meta["minimum"]:
            return self.fail(f"{key}={_show(value)}: must be >= {meta['minimum']}")
        if "maximum" in meta and value > meta["maximum"]:
            return self.fail(f"{key}={_show(value)}: must be <= {meta['maximum']}")
        if "exclusive_minimum" in meta and value <= meta["exclusive_minimum"]:
            return self.fail(f"{key}={_show(value)}: must be > {meta['exclusive_minimum']}")
        if "exclusive_maximum" in meta and value >= meta["exclusive_maximum"]:
            return self.fail(f"{key}={_show(value)}: must be < {meta['exclusive_maximum']}")
        return value

    def check_component(self, value: Any, key: str, meta: Mapping[str, Any]) -> Any:
        if not isinstance(value, Mapping):
            return self.fail(f"{key}={_show(value)}: expected a mapping with _component_")
        try:
            component = parse_component(value, key, self.extra_allowed)
            problems = component.check_arguments(meta.get("positional", 0), meta.get("recipe_kwargs", ()),
                                                 partial=meta.get("partial", False))
        except UserError as err:
            return self.fail(str(err))
        if problems:
            self.problems.extend(problems)
            return _MISSING
        return component

    def check_dataclass(self, value: Any, cls: type, key: str) -> Any:
        prefix = f"{key}." if key else ""
        if not isinstance(value, Mapping):
            return self.fail(f"{key or 'config'}={_show(value)}: expected a mapping")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        hints = typing.get_type_hints(cls)
        # A flattened group keeps its keys at this level: key -> the field holding the group.
        flattened = {
            sub.name: name
            for name, f in fields.items()
            if f.metadata.get("flatten")
            for sub in dataclasses.fields(hints[name])
        }
        known = [name for name, f in fields.items() if not f.metadata.get("flatten")] + list(flattened)
        for name in value:
            if name not in known:
                hint = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
                # `lr=0.1` for `optimizer.lr=0.1`: a component at this level that takes the key by that name.
                owners = [sub for sub, node in value.items()
                          if isinstance(node, Mapping) and "_component_" in node and name in node]
                other_recipe = getattr(cls, "keys_of_other_recipes", {}).get(name)
                suggestion = (f" (a key of the {other_recipe} recipe: is this config for `tune run {other_recipe}`?)"
                              if other_recipe else f" (did you mean {prefix}{hint[0]}?)" if hint
                              else f" (did you mean {prefix}{owners[0]}.{name}?)" if owners
                              else f" (a variable of your own goes under {USER_VARS_KEY}:, read as "
                                   f"${{{USER_VARS_KEY}.{name}}})" if not key else "")
                self.fail(f"{prefix}{name}: unknown key{suggestion}")
        from_config = getattr(cls, "from_config", None)
        if from_config is not None:
            return self.check_self_validating(value, from_config)
        kwargs = {}
        for name, f in fields.items():
            if f.metadata.get("flatten"):
                group = {k: v for k, v in value.items() if flattened.get(k) == name}
                kwargs[name] = self.check_dataclass(group, hints[name], key)
            elif name in value:
                kwargs[name] = self.check(value[name], hints[name], f"{prefix}{name}", f.metadata)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                self.fail(f"{prefix}{name}: required key is missing")
        if self.problems or _MISSING in kwargs.values():
            return _MISSING
        return cls(**kwargs)

    def check_self_validating(self, value: Mapping[str, Any], from_config: Any) -> Any:
        """A group that validates itself (``from_config`` raises a ``UserError`` with ``problems``)."""
        try:
            return from_config(value)
        except UserError as err:
            self.problems.extend(getattr(err, "problems", None) or [str(err)])
            return _MISSING


def validate_config(cfg: DictConfig | Mapping[str, Any], schema: type[T], *, source: str,
                    extra_allowed_components: Sequence[str] = (), overrides: Sequence[str] = ()) -> T:
    """Check ``cfg`` against the dataclass ``schema`` and build the typed config.

    Args:
        cfg: a loaded config (interpolations already resolved).
        schema: the recipe's dataclass.
        source: what to call the config in messages (usually its file path).
        extra_allowed_components: module prefixes the user explicitly allowed for ``_component_``.
        overrides: the command-line overrides applied to ``cfg``: a problem with a key they set is introduced by
            "command line", not by ``source``.

    The top-level ``vars`` mapping (:data:`USER_VARS_KEY`) holds the user's own variables for interpolation; it
    must be a mapping, and its keys are not checked.

    Returns:
        An instance of ``schema``.

    Raises:
        UserError: ``cfg`` is a torchtune config (one line pointing at ``tune migrate``).
        ConfigError: listing every problem found (unknown keys with suggestions, wrong types, values out of
            range, missing required keys, refused or unknown components, bad component arguments, and what
            self-validating groups such as ``ACConfig`` report).
    """
    plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    if isinstance(plain, Mapping) and torchtune_marker(plain) is not None:
        raise UserError(f"{source} looks like a torchtune config; convert it with: tune migrate {source} -o NEW.yaml")
    checker = _Checker(extra_allowed_components)
    plain = dict(plain)
    user_vars = plain.pop(USER_VARS_KEY, {})
    if not isinstance(user_vars, Mapping):
        checker.fail(f"{USER_VARS_KEY}={_show(user_vars)}: expected a mapping of your own variables (name: value), "
                     f"used as ${{{USER_VARS_KEY}.name}}")
    result = checker.check_dataclass(plain, schema, "")
    if checker.problems:
        from_command_line = [i for i, p in enumerate(checker.problems) if _set_on_command_line(p, overrides)]
        raise ConfigError(source, checker.problems, from_command_line)
    return result


_COMPONENT_KEY = "_component_"


def torchtune_marker(cfg: Mapping[str, Any]) -> Optional[str]:
    """What makes ``cfg`` a torchtune config, or None: a ``_component_`` under ``torchtune.`` or a
    ``checkpointer`` key (torchtune's; this project has ``checkpoint_dir``)."""
    if "checkpointer" in cfg:
        return "checkpointer"
    for key, path in _components(cfg, ""):
        if path.startswith("torchtune."):
            return f"{key}._component_={path}"
    return None


def _components(node: Any, key: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, Mapping):
        path = node.get(_COMPONENT_KEY)
        if isinstance(path, str):
            yield key or _COMPONENT_KEY, path
        for name, value in node.items():
            yield from _components(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _components(value, f"{key}[{index}]")
