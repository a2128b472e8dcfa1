"""The mark that makes a torchtune_ac function nameable by a config's ``_component_``.

Only marked functions can be instantiated from a config by default (plus torch's optimizers, LR schedulers
and ``nn`` modules, see ``torchtune_ac.config.components``): a config file from the internet must not be
able to call an arbitrary function of this package, such as one that writes or deletes files.
Kept free of imports so that models and data modules can use it without pulling in the config machinery.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__tune_config_component__"


def config_component(fn: F) -> F:
    """Mark ``fn`` as a builder a config may name with ``_component_`` (returns ``fn`` unchanged)."""
    setattr(fn, _MARK, True)
    return fn


def is_config_component(obj: Any) -> bool:
    """Whether ``obj`` itself (not a class it inherits from) was marked with :func:`config_component`."""
    return getattr(obj, "__dict__", {}).get(_MARK) is True
