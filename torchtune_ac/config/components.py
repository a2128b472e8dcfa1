"""``_component_`` nodes: allow-listed dotted paths instantiated with their keyword arguments.

A YAML file from the internet must not be able to run code just by being loaded, so what a config may name
is a positive list, checked twice:

1. Before anything is imported, the dotted path must lie under ``torchtune_ac``, ``torch.optim`` or
   ``torch.nn`` and contain no private names (``_x``).
2. After import, before anything is called, every module passed through must really be the module the path
   names (``torchtune_ac.cli.os`` is ``os``, refused), and the object must be either a torchtune_ac function marked
   with ``@config_component`` (model builders, tokenizer, datasets, LR schedules) or a class from
   ``torch.optim`` / ``torch.nn`` that is an optimizer, an LR scheduler or an ``nn.Module``.

Besides, a few components of optional packages are allowed by their exact path (``OPTIONAL_COMPONENTS``): torchao's
low-bit AdamW optimizers. A missing package is a user error naming the extra that installs it.

Everything else in torch (``torch.load``, ``torch.onnx.export``, ``torch.utils.collect_env.run``, ...) and in
torchtune_ac (``save_hf``, ...) is refused. More can be allowed only by the person running the command
(``--allow-component PREFIX`` or ``TUNE_ALLOWED_COMPONENTS=a,b``), never by the config file itself, which is
exactly what is not trusted; an allowed prefix admits objects defined under it (or allowed by default), and the
exact path allowed admits the object it names. A refusal suggests the exact path, the narrowest grant.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import logging
import os
import types
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from torchtune_ac.compat.torchtune.paths import resolve_alias
from torchtune_ac.component_marker import is_config_component
from torchtune_ac.errors import UserError

COMPONENT_KEY = "_component_"
ALLOWED_ENV_VAR = "TUNE_ALLOWED_COMPONENTS"
# Where default components may be imported from (step 1 above).
DEFAULT_IMPORTABLE_PREFIXES = ("torchtune_ac", "torch.optim", "torch.nn")
# Optimizers of optional packages allowed by their exact path -> the extra (pyproject.toml) that installs them.
OPTIONAL_COMPONENTS = {
    "torchao.optim.AdamW8bit": "ao",
    "torchao.optim.AdamW4bit": "ao",
    # AdamW whose bf16_stochastic_round=True rounds bf16 weights stochastically; torchao names it privately.
    "torchao.optim._AdamW": "ao",
}
DEFAULT_ALLOWED_DESCRIPTION = (
    "by default a component is a torchtune_ac builder (models, tokenizer, datasets, LR schedules), a "
    "torch.optim / torch.nn class (optimizer, LR scheduler, module), or one of torchao's low-bit AdamW ("
    + ", ".join(OPTIONAL_COMPONENTS) + ")"
)


def _matches(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _user_allowed(extra: Sequence[str]) -> tuple[str, ...]:
    from_env = [p.strip() for p in os.environ.get(ALLOWED_ENV_VAR, "").split(",") if p.strip()]
    return tuple(extra) + tuple(from_env)


def _how_to_allow(prefix: str) -> str:
    return f"to allow it, pass --allow-component {prefix} or set {ALLOWED_ENV_VAR}={prefix}"


def check_component_path(path: str, key: str, extra_allowed: Sequence[str] = ()) -> None:
    """Refuse ``path`` before anything is imported unless it may hold a component.

    Raises:
        UserError: malformed path, private name, or a module outside the importable prefixes.
    """
    parts = path.split(".")
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise UserError(f"{key}._component_={path!r}: expected a dotted path such as torch.optim.AdamW")
    if path in OPTIONAL_COMPONENTS or any(_matches(path, prefix) for prefix in _user_allowed(extra_allowed)):
        return
    if any(part.startswith("_") for part in parts):
        raise UserError(f"{key}._component_={path}: private names (starting with _) cannot be instantiated")
    if not any(_matches(path, prefix) for prefix in DEFAULT_IMPORTABLE_PREFIXES):
        # The path itself, not its module: `torch.load`'s would be `torch`, which allows all of torch.
        raise UserError(f"{key}._component_={path}: not allowed; {DEFAULT_ALLOWED_DESCRIPTION}; {_how_to_allow(path)}")


def _is_default_component(obj: Any) -> bool:
    if is_config_component(obj):
        return obj.__module__.startswith("torchtune_ac.")
    if not inspect.isclass(obj) or not (_matches(obj.__module__, "torch.optim") or _matches(obj.__module__, "torch.nn")):
        return False
    import torch

    return issubclass(obj, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.nn.Module))


def _is_optional_optimizer(obj: Any, path: str) -> bool:
    """``obj`` is the optimizer class ``OPTIONAL_COMPONENTS`` names by ``path``, defined in that package."""
    if path not in OPTIONAL_COMPONENTS or not inspect.isclass(obj):
        return False
    import torch

    return _matches(obj.__module__, path.split(".")[0]) and issubclass(obj, torch.optim.Optimizer)


def _check_found_object(obj: Any, path: str, key: str, extra_allowed: Sequence[str]) -> None:
    """Refuse the object ``path`` led to unless it is a default component, defined under a user prefix, or named
    by exactly the path the user allowed (``--allow-component torch.load``: torch.load lives in torch.serialization).
    """
    if _is_default_component(obj) or _is_optional_optimizer(obj, path) or path in _user_allowed(extra_allowed):
        return
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and any(_matches(module, prefix) for prefix in _user_allowed(extra_allowed)):
        return
    defined = f"{module}.{getattr(obj, '__qualname__', '?')}" if isinstance(module, str) else "an object"
    where = "" if defined == path else f" (it is {defined})"
    raise UserError(
        f"{key}._component_={path}: not allowed{where}; {DEFAULT_ALLOWED_DESCRIPTION}; {_how_to_allow(path)}"
    )


def import_component(path: str, key: str, extra_allowed: Sequence[str] = ()) -> Callable[..., Any]:
    """Import the object named by a dotted ``path`` (already checked by ``check_component_path``) and check it. A
    path that mirrors torchtune's (``compat/torchtune/paths.py``) imports the object it stands for.

    Raises:
        UserError: the module or attribute does not exist, a module on the way is not the one the path names,
            or the object is not an allowed component.
    """
    path = resolve_alias(path)
    parts = path.split(".")
    # The longest importable prefix is the module; the rest are attributes (a.b.Class works too).
    for split in range(len(parts) - 1, 0, -1):
        module_path = ".".join(parts[:split])
        try:
            with _quiet_import(path):
                obj: Any = importlib.import_module(module_path)
        except ModuleNotFoundError as err:
            if err.name is None or not module_path.startswith(err.name):
                raise  # the module exists but one of its own imports is missing: not the user's mistake
            if path in OPTIONAL_COMPONENTS and err.name == parts[0]:
                raise UserError(f"{key}._component_={path}: needs the {parts[0]} package, which is not installed: "
                                f"pip install 'torchtune_ac[{OPTIONAL_COMPONENTS[path]}]'") from None
            continue
        for attr in parts[split:]:
            if not hasattr(obj, attr):
                candidates = [name for name in dir(obj) if not name.startswith("_")]
                hint = difflib.get_close_matches(attr, candidates, n=1)
                suggestion = f" (did you mean {module_path}.{hint[0]}?)" if hint else ""
                raise UserError(f"{key}._component_={path}: {module_path} has no attribute {attr}{suggestion}")
            obj = getattr(obj, attr)
            module_path = f"{module_path}.{attr}"
            if inspect.ismodule(obj) and obj.__name__ != module_path:
                # A module's namespace also holds what it imported: torchtune_ac.cli.os is the os module.
                raise UserError(f"{key}._component_={path}: not allowed ({module_path} is the module {obj.__name__})")
        _check_found_object(obj, path, key, extra_allowed)
        if not callable(obj):
            raise UserError(f"{key}._component_={path}: is not callable")
        return obj
    raise UserError(f"{key}._component_={path}: no module named {parts[0]}")


@contextlib.contextmanager
def _quiet_import(path: str) -> Iterator[None]:
    """Importing torchao logs a warning for each of its CUDA kernels' libraries this machine cannot load, and torch
    a deprecation for one of its enums: noise about parts an optimizer does not use. Quiet for that import only."""
    if path not in OPTIONAL_COMPONENTS:
        yield
        return
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


_YAML_SCALARS = (bool, int, float, str, type(None))


def _accepts_scalar(annotation: Any, value: Any) -> Optional[bool]:
    """Whether a YAML scalar ``value`` fits a parameter annotated ``annotation``; None when it cannot tell."""
    if annotation is Any:
        return None
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        answers = [_accepts_scalar(arg, value) for arg in typing.get_args(annotation)]
        return True if True in answers else (None if None in answers else False)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is not None:  # list[...], tuple[...], dict[...], Iterable[...]: a scalar is none of them
        return False
    import torch

    if annotation is torch.Tensor:  # a config cannot hold a tensor
        return False
    return None  # another class: it may well convert a string or number itself


def _describe_annotation(annotation: Any) -> str:
    if isinstance(annotation, type):
        return "null" if annotation is type(None) else annotation.__name__
    return str(annotation).replace("typing.", "")


@dataclass(frozen=True)
class Component:
    """A validated ``_component_`` node: where it sits in the config, its dotted path and keyword arguments."""

    key: str
    path: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    # Prefixes the person running the command allowed (--allow-component), needed again at import time.
    extra_allowed: tuple[str, ...] = field(default=(), compare=False)

    def target(self) -> Callable[..., Any]:
        return import_component(self.path, self.key, self.extra_allowed)

    def check_arguments(self, n_positional: int = 0, extra_kwargs: Sequence[str] = (), *,
                        partial: bool = False) -> list[str]:
        """Problems with this node's keyword arguments, and those of nested components (nothing is called).

        Each name must be a parameter of the target, and each plain value (number, string, bool, null) must
        fit the parameter's annotation where there is one (``optimizer.lr='abc'`` is reported here, not
        after the model is built). ``n_positional`` positional arguments and ``extra_kwargs`` names are
        supplied by the recipe at instantiation time; a config that also sets one of those names is reported. With
        ``partial``, arguments may be left for the run to give (a reward function's dataset columns).
        """
        target = self.target()
        problems = [p for value in self.kwargs.values() for p in _nested_problems(value)]
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return problems
        problems += self._type_problems(target)
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
            for name in extra_kwargs:
                if name not in names:
                    problems.append(f"{self.key}: {self.path} takes no {name} argument, which the recipe passes "
                                    f"to every {self.key}")
            for name in self.kwargs:
                if name not in names and name not in extra_kwargs:
                    hint = difflib.get_close_matches(name, names, n=1)
                    accepted = ", ".join(names[n_positional:]) or "none"
                    suggestion = f" (did you mean {hint[0]}?)" if hint else f" (accepted: {accepted})"
                    problems.append(f"{self.key}.{name}: not an argument of {self.path}{suggestion}")
        placeholders = [object()] * n_positional
        supplied = {name: None for name in list(self.kwargs) + list(extra_kwargs) if accepts_any or name in names}
        try:
            (signature.bind_partial if partial else signature.bind)(*placeholders, **supplied)
        except TypeError as err:
            if not problems:
                problems.append(f"{self.key}: {self.path}: {err}")
        return problems

    def _type_problems(self, target: Callable[..., Any]) -> list[str]:
        try:
            hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
        except Exception:  # noqa: BLE001 - unresolvable annotations: nothing to check against
            return []
        problems = []
        for name, value in self.kwargs.items():
            if name in hints and isinstance(value, _YAML_SCALARS) and _accepts_scalar(hints[name], value) is False:
                shown = "null" if value is None else repr(value)
                problems.append(
                    f"{self.key}.{name}={shown}: expected {_describe_annotation(hints[name])} "
                    f"(argument of {self.path})"
                )
        return problems

    def as_config(self) -> dict[str, Any]:
        """This node as it would be written in YAML (``_component_`` plus arguments, nested nodes too)."""
        return {COMPONENT_KEY: self.path, **{name: _as_config(value) for name, value in self.kwargs.items()}}

    def instantiate(self, *args: Any, **extra_kwargs: Any) -> Any:
        """Call the target with ``args``, this node's kwargs (nested components built first) and ``extra_kwargs``.

        Raises:
            UserError: the target raised (it rejected its arguments: a TypeError, a ValueError, an IndexError for
                ``betas=[0.9]``, ...), naming this node's key, the target and the arguments the config gave it.
        """
        kwargs = {name: _instantiate_nested(value, f"{self.key}.{name}") for name, value in self.kwargs.items()}
        kwargs.update(extra_kwargs)
        try:
            return self.target()(*args, **kwargs)
        except UserError as err:
            # Our builders name a bad argument as `template='foo'`; from the config it is `dataset.template`.
            message = str(err)
            if not any(message.startswith(f"{name}=") for name in self.kwargs):
                raise
            raise UserError(f"{self.key}.{message}") from None
        except Exception as err:  # noqa: BLE001 - whatever a component raises on its arguments is the config's doing
            given = ", ".join(f"{name}={_show_argument(value)}" for name, value in self.kwargs.items())
            detail = str(err).splitlines()[0] if str(err) else ""
            kind = "" if isinstance(err, (TypeError, ValueError)) else f"{type(err).__name__}: "
            raise UserError(f"{self.key} ({self.path}): {kind}{detail}{f' (arguments: {given})' if given else ''}") from err


    def instantiate_with_defaults(self, *args: Any, **defaults: Any) -> Any:
        """``instantiate``, passing each of ``defaults`` only when the target takes an argument of that name and
        this node does not set it (``model: {_component_: ...from_hf_config}`` gets the run's checkpoint_dir)."""
        try:
            parameters = inspect.signature(self.target()).parameters
        except (TypeError, ValueError):
            parameters = {}
        wanted = {name: value for name, value in defaults.items() if name in parameters and name not in self.kwargs}
        return self.instantiate(*args, **wanted)


def _show_argument(value: Any) -> str:
    text = repr(value.as_config() if isinstance(value, Component) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_config(value: Any) -> Any:
    if isinstance(value, Component):
        return value.as_config()
    if isinstance(value, Mapping):
        return {k: _as_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_config(v) for v in value]
    return value


def _nested_problems(value: Any) -> list[str]:
    if isinstance(value, Component):
        return value.check_arguments()
    if isinstance(value, Mapping):
        return [p for v in value.values() for p in _nested_problems(v)]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _nested_problems(v)]
    return []


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
    return Component(key=key, path=path, kwargs=kwargs, extra_allowed=tuple(extra_allowed))


def _parse_nested(value: Any, key: str, extra_allowed: Sequence[str]) -> Any:
    if isinstance(value, Mapping):
        if COMPONENT_KEY in value:
            return parse_component(value, key, extra_allowed)
        return {k: _parse_nested(v, f"{key}.{k}", extra_allowed) for k, v in value.items()}
    if isinstance(value, list):
        return [_parse_nested(v, f"{key}[{i}]", extra_allowed) for i, v in enumerate(value)]
    return value
