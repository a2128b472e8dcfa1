"""The memory-switch contract: one module declares everything about one way of saving memory.

A switch (activation checkpointing, the optimizer step in backward, the chunked loss, ...) is a module under
``torchtune_ac/memory/switches/`` that defines ``SWITCH``, an object following ``MemorySwitch``. It declares:

- its config keys (``config_class``: a frozen dataclass whose fields are top-level YAML keys) and their
  validation (the schema checks types and bounds; ``resolve`` checks the combination with the model and the
  other keys and turns them into the switch's *setting*);
- how it is applied: to the model before it is sharded (``apply_to_model``), to the optimizer
  (``build_stepper``: who steps the parameters, and when) or to the step (``objective``: how the loss is
  computed);
- what it costs in the planner: the planner simulates the real step with every switch applied, so most costs
  are measured there; ``planner_cost`` adds what a simulation cannot see (bytes per category, on the device or
  on the host);
- what the planner suggests with it when nothing fits (``alternatives``).

``MemoryPlan`` (``plan.py``), ``tune validate``, ``tune plan``, the planner and the recipe iterate over
``SWITCHES``; none of them names a switch. Adding one is one module here plus its mechanism and tests.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Protocol

from torch import nn


@dataclass(frozen=True)
class SwitchContext:
    """What resolving a switch may look at besides its own keys.

    Attributes:
        model: the model the run trains (built, or on the meta device).
        vocab_size: the vocabulary the loss projects to (None for a model of no known family).
        clip_grad_norm: the config's value.
        settings: the settings of the switches resolved before this one (by ``SWITCH.name``).
    """

    model: nn.Module
    vocab_size: Optional[int]
    clip_grad_norm: Optional[float]
    settings: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Alternative:
    """A change the planner tries when nothing fits: the switch's new setting, and (rarely) other workload
    fields the change needs (``{"clip_grad_norm": None}`` with the step in backward)."""

    label: str
    setting: Any
    workload_changes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SwitchCost:
    """What a switch adds to a simulated step's estimate, in bytes per process, by category
    (``parameters``, ``optimizer``, ``gradients``, ``activations``, ``transient``): ``device`` on the
    accelerator (negative: moved off it), ``host`` in the host's memory."""

    device: Mapping[str, int] = field(default_factory=dict)
    host: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSizes:
    """The model's sizes a switch's ``planner_cost`` may use, in bytes (whole model, not per process)."""

    parameters: int
    root_parameters: int  # outside the transformer blocks (embeddings, final norm, output)
    largest_block: int
    optimizer_state: int
    world_size: int


class MemorySwitch(Protocol):
    """One memory switch (see the module docstring). Methods a switch does not need return None / nothing."""

    #: The switch's name: its group in ``MemoryConfig`` and its key in ``MemoryPlan.settings``.
    name: str
    #: The label of its line in ``tune validate`` and the run's log.
    label: str
    #: Where it comes in ``tune validate`` and in the planner's suggestions (lower first).
    order: int
    #: A frozen dataclass of its config keys (top-level YAML keys), with their defaults and bounds.
    config_class: type
    #: The setting that saves nothing: what a workload or a plan that does not name the switch means.
    off: Any

    def resolve(self, config: Any, ctx: SwitchContext) -> Any:
        """The switch's setting for this model and config. Raises ``UserError`` naming the keys of a combination
        that cannot work."""

    def describe(self, setting: Any, vocab_size: Optional[int]) -> str:
        """The value of its ``tune validate`` line (``vocab_size``: the model's, None when unknown)."""

    def apply_to_model(self, model: nn.Module, setting: Any) -> None:
        """Change the model in place before it is sharded (activation checkpointing)."""

    def build_stepper(self, setting: Any, make_optimizer: Callable[[Iterable[nn.Parameter]], Any],
                      model: nn.Module) -> Optional[Any]:
        """The ``training.step.Stepper`` of the model's parameters, or None to leave it to another switch (the
        default steps after backward)."""

    def objective(self, setting: Any) -> Optional[Any]:
        """The ``training.objective.Objective`` the step computes, or None for the default."""

    def planner_cost(self, setting: Any, sizes: ModelSizes) -> SwitchCost:
        """What the simulated step does not show (see ``SwitchCost``)."""

    def alternatives(self, setting: Any) -> list[Alternative]:
        """Settings worth estimating when nothing fits, each with a label such as ``loss_chunks=8``."""

    def resume_record(self, setting: Any) -> Mapping[str, Any]:
        """What a resume must keep of this setting (recorded in the checkpoint, compared on resume); empty when
        the setting can change between a run and its resume."""


class SwitchDefaults:
    """The do-nothing answers of ``MemorySwitch``, for a switch to inherit those it does not need."""

    def apply_to_model(self, model: nn.Module, setting: Any) -> None:
        return None

    def build_stepper(self, setting: Any, make_optimizer: Callable[[Iterable[nn.Parameter]], Any],
                      model: nn.Module) -> Optional[Any]:
        return None

    def objective(self, setting: Any) -> Optional[Any]:
        return None

    def planner_cost(self, setting: Any, sizes: ModelSizes) -> SwitchCost:
        return SwitchCost()

    def alternatives(self, setting: Any) -> list[Alternative]:
        return []

    def resume_record(self, setting: Any) -> Mapping[str, Any]:
        return {}


@functools.cache
def discover_switches() -> tuple[MemorySwitch, ...]:
    """Every ``SWITCH`` defined by a module of ``torchtune_ac.memory.switches``, in ``order``."""
    from torchtune_ac.memory import switches as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "SWITCH"):
            found.append(module.SWITCH)
    names = [s.name for s in found]
    if len(set(names)) != len(names):
        raise RuntimeError(f"two memory switches share a name: {sorted(names)}")
    return tuple(sorted(found, key=lambda s: (s.order, s.name)))
