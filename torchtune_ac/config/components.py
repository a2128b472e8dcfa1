"""``_component_`` nodes: allow-listed dotted paths instantiated with their keyword arguments.

A YAML file from the internet must not be able to run code just by being loaded, so a path is checked
against an allow-list *before* anything is imported. Allowed by default: ``torchtune_ac`` (which includes the
shipped recipes) and ``torch`` minus its code-loading entry points. More prefixes can be allowed only by
the person running the command (``--allow-component PREFIX`` or ``TUNE_ALLOWED_COMPONENTS=a,b``), never by
the config file itself, which is exactly what is not trusted.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from torchtune_ac.errors import UserError

COMPONENT_KEY = "_component_"
ALLOWED_ENV_VAR = "TUNE_ALLOWED_COMPONENTS"
DEFAULT_ALLOWED_PREFIXES = ("torchtune_ac", "torch")
# Parts of torch that load or compile code, or unpickle: reachable from Python, never from a config.
DENIED_PREFIXES = (
    "torch.hub",
    "torch.load",
    "torch.save",
    "torch.package",
    "torch.utils.cpp_extension",
    "torch.jit.load",
    "torch.ops",
    "torch.classes",
    "torch.compile",
    "torch.export",
    "torch.distributed.run",
    "torch.distributed.elastic",
    "torch.multiprocessing",
    "torch.utils.data.datapipes",
)


def _matches(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _extra_allowed(extra: Sequence[str]) -> tuple[str, ...]:
    from_env = [p.strip() for p in os.environ.get(ALLOWED_ENV_VAR, "").split(",") if p.strip()]
    return tuple(extra) + tuple(from_env)


def check_component_path(path: str, key: str, extra_allowed: Sequence[str] = ()) -> None:
    """Refuse ``path`` unless it is allow-listed; nothing is imported.

    Raises:
        UserError: malformed path, private name, or a module outside the allow-list.
    """
    parts = path.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise UserError(f"{key}._component_={path!r}: expected a dotted path such as torch.optim.AdamW")
    if not any(_matches(path, prefix) for prefix in _extra_allowed(extra_allowed)):
        if any(part.startswith("_") for part in parts):
            raise UserError(f"{key}._component_={path}: private names (starting with _) cannot be instantiated")
        if any(_matches(path, prefix) for prefix in DENIED_PREFIXES) or not any(
            _matches(path, prefix) for prefix in DEFAULT_ALLOWED_PREFIXES
        ):
            raise UserError(
                f"{key}._component_={path}: not allowed; components may come from torchtune_ac or torch. "
                f"To allow it, pass --allow-component {parts[0]} or set {ALLOWED_ENV_VAR}={parts[0]}"
            )


def import_component(path: str, key: str) -> Callable[..., Any]:
    """Import the object named by an (already allow-listed) dotted ``path``.

    Raises:
        UserError: the module or attribute does not exist, or is not callable.
    """
    parts = path.split(".")
    # The longest importable prefix is the module; the rest are attributes (a.b.Class.method works too).
    for split in range(len(parts) - 1, 0, -1):
        module_path = ".".join(parts[:split])
        try:
            obj: Any = importlib.import_module(module_path)
        except ModuleNotFoundError as err:
            if err.name is None or not module_path.startswith(err.name):
                raise  # the module exists but one of its own imports is missing: not the user's mistake
            continue
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                candidates = [name for name in dir(obj) if not name.startswith("_")]
                hint = difflib.get_close_matches(attr, candidates, n=1)
                suggestion = f" (did you mean {module_path}.{hint[0]}?)" if hint else ""
                raise UserError(f"{key}._component_={path}: {module_path} has no attribute {attr}{suggestion}")
            obj = getattr(obj, attr)
            module_path = f"{module_path}.{attr}"
        if not callable(obj):
            raise UserError(f"{key}._component_={path}: is not callable")
        return obj
    raise UserError(f"{key}._component_={path}: no module named {parts[0]}")


@dataclass(frozen=True)
class Component:
    """A validated ``_component_`` node: where it sits in the config, its dotted path and keyword arguments."""

    key: str
    path: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def target(self) -> Callable[..., Any]:
        return import_component(self.path, self.key)

    def check_arguments(self, n_positional: int = 0, extra_kwargs: Sequence[str] = ()) -> list[str]:
        """Problems binding this node's keyword arguments to the target's signature (nothing is called).

        ``n_positional`` positional arguments and ``extra_kwargs`` names are supplied by the recipe at
        instantiation time; a config that also sets one of those names is reported.
        """
        target = self.target()
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return []
        problems = []
        for name in extra_kwargs:
            if name in self.kwargs:
                problems.append(f"{self.key}.{name}: set by the recipe, remove it from the config")
        accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        names = [
            p.name
            for p in signature.parameters.values()
            if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ]
        if not accepts_any:
            for name in self.kwargs:
                if name not in names and name not in extra_kwargs:
                    hint = difflib.get_close_matches(name, names, n=1)
                    accepted = ", ".join(names[n_positional:]) or "none"
                    suggestion = f" (did you mean {hint[0]}?)" if hint else f" (accepted: {accepted})"
                    problems.append(f"{self.key}.{name}: not an argument of {self.path}{suggestion}")
        placeholders = [object()] * n_positional
        supplied = {name: None for name in list(self.kwargs) + list(extra_kwargs) if accepts_any or name in names}
        try:
            signature.bind(*placeholders, **supplied)
        except TypeError as err:
            if not problems:
                problems.append(f"{self.key}: {self.path}: {err}")
        return problems

    def instantiate(self, *args: Any, **extra_kwargs: Any) -> Any:
        """Call the target with ``args``, this node's kwargs (nested components built first) and ``extra_kwargs``.

        Raises:
            UserError: the target rejected its arguments (TypeError/ValueError), naming this node's key.
        """
        kwargs = {name: _instantiate_nested(value, f"{self.key}.{name}") for name, value in self.kwargs.items()}
        kwargs.update(extra_kwargs)
        try:
            return self.target()(*args, **kwargs)
        except UserError:
            raise
        except (TypeError, ValueError) as err:
            raise UserError(f"{self.key} ({self.path}): {err}") from err


def _instantiate_nested(value: Any, key: str) -> Any:
    if isinstance(value, Component):
        return value.instantiate()
    if isinstance(value, Mapping):
        return {k: _instantiate_nested(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_instantiate_nested(v, f"{key}[{i}]") for i, v in enumerate(value))
    return value


def parse_component(node: Mapping[str, Any], key: str, extra_allowed: Sequence[str] = ()) -> Component:
    """Turn a plain mapping with ``_component_`` into a ``Component`` (nested components too), allow-list checked.

    Raises:
        UserError: ``_component_`` missing or not a string, or a path that is not allowed.
    """
    if COMPONENT_KEY not in node:
        raise UserError(f"{key}: expected a mapping with a _component_ key (e.g. _component_: torch.optim.AdamW)")
    path = node[COMPONENT_KEY]
    if not isinstance(path, str):
        raise UserError(f"{key}._component_={path!r}: expected a dotted path string")
    check_component_path(path, key, extra_allowed)
    kwargs = {
        name: _parse_nested(value, f"{key}.{name}", extra_allowed)
        for name, value in node.items()
        if name != COMPONENT_KEY
    }
    return Component(key=key, path=path, kwargs=kwargs)


def _parse_nested(value: Any, key: str, extra_allowed: Sequence[str]) -> Any:
    if isinstance(value, Mapping):
        if COMPONENT_KEY in value:
            return parse_component(value, key, extra_allowed)
        return {k: _parse_nested(v, f"{key}.{k}", extra_allowed) for k, v in value.items()}
    if isinstance(value, list):
        return [_parse_nested(v, f"{key}[{i}]", extra_allowed) for i, v in enumerate(value)]
    return value
