"""The memory-switch contract: one module declares everything about one way of saving memory.

A switch (activation checkpointing, the optimizer step in backward, the chunked loss, ...) is a module under
``torchtune_ac/memory/switches/`` that defines ``SWITCH``, an object following ``MemorySwitch``. It declares:

- its config keys (``config_class``: a frozen dataclass whose fields are top-level YAML keys, or keys of the
  schema group ``group`` names, such as ``fsdp.cpu_offload``) and their validation (the schema checks types and
  bounds; ``resolve`` checks the combination with the model and the rest of the config, and turns them into the
  switch's *setting*); a switch may have no keys of its own and read what it needs of the config from the
  context (the optimizer's state layout comes from ``optimizer._component_``);
- where it can run (``check_device``: a CUDA-only mechanism says so for a run on the CPU);
- how it is applied: to the model before it is sharded (``apply_to_model``), to the sharding
  (``shard_options``: arguments for FSDP2's ``fully_shard``, which then shards a world of one too), to the
  optimizer (``wrap_optimizer``; ``build_stepper``: who steps the parameters, and when) or to the step
  (``objective``: how the loss is computed);
- what it costs in the planner: the planner simulates the real step with every switch applied, so most costs
  are measured there; ``planner_cost`` adds what a simulation cannot see (bytes per category, on the device or
  on the host), and ``planner_optimizer`` gives a stand-in for an optimizer that cannot run under fake tensors;
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

import torch
from torch import nn

# The schema groups a switch's keys may sit in besides the top level (``group``), each extending the group's own
# settings class in ``plan.py``.
KEY_GROUPS = ("fsdp",)
MakeOptimizer = Callable[[Iterable[nn.Parameter]], Any]


@dataclass(frozen=True)
class OptimizerSpec:
    """The config's optimizer as written (``optimizer._component_`` and its arguments), for a switch that depends
    on which optimizer it is; nothing is imported or built from it."""

    path: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SwitchContext:
    """What resolving a switch may look at besides its own keys.

    Attributes:
        model: the model the run trains (built, or on the meta device).
        vocab_size: the vocabulary the loss projects to (None for a model of no known family).
        clip_grad_norm: the config's value.
        settings: the settings of the switches resolved before this one (by ``SWITCH.name``).
        optimizer: the config's optimizer (None where a plan is built without one, for AC alone).
        dtype: the storage dtype of parameters (``dtype``).
        device: the config's ``device`` (``auto``, ``cpu`` or ``cuda``): ``cpu`` is a choice the config made, and
            a CUDA-only switch refuses it here; what ``auto`` finds is checked by ``check_device``.
    """

    model: nn.Module
    vocab_size: Optional[int]
    clip_grad_norm: Optional[float]
    settings: Mapping[str, Any] = field(default_factory=dict)
    optimizer: Optional[OptimizerSpec] = None
    dtype: torch.dtype = torch.float32
    device: str = "auto"


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
    """What a switch's ``planner_cost`` may use: the model's sizes in bytes (whole model, not per process, unless
    said otherwise), and the estimate it changes.

    Attributes:
        parameters: every parameter.
        root_parameters: those outside the transformer blocks (embeddings, final norm, output).
        largest_block: one transformer block's.
        optimizer_state: the optimizer state as simulated (the stand-in's, where ``planner_optimizer`` gave one).
        world_size: processes each parameter is sharded over (FSDP2's shard degree: every process, or one row of
            HSDP's ``fsdp.replicate_degree`` rows); 1 when not sharded.
        shapes: every parameter's shape (a tied weight once), at the model's whole depth.
        dtype: the parameters' storage dtype.
        sharded: FSDP2 shards the model (several processes, or a switch's ``shard_options`` on one).
        gathered_parameters: what FSDP2 holds gathered at once beyond nothing (the root and the running and
            prefetched blocks; every block without ``fsdp.reshard_after_forward``), unsharded; 0 when not sharded.
        checkpointed_blocks: the blocks the AC plan checkpoints (each keeps only its input for backward).
        block_input: bytes of one block's input for one micro-batch (per process).
        max_gradients: the most gradient bytes alive at one phase's peak (per process): all of them at the optimizer
            step after backward, a few with the step in backward.
        so_far: per process, on the device, by category (``parameters``, ``optimizer``, ``gradients``,
            ``activations``, ``transient``): the simulated estimate with the switches before this one applied.
    """

    parameters: int
    root_parameters: int
    largest_block: int
    optimizer_state: int
    world_size: int
    shapes: tuple[tuple[int, ...], ...] = ()
    dtype: torch.dtype = torch.float32
    sharded: bool = False
    gathered_parameters: int = 0
    checkpointed_blocks: int = 0
    block_input: int = 0
    max_gradients: int = 0
    so_far: Mapping[str, int] = field(default_factory=dict)


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
    #: The schema group its keys sit in (one of ``KEY_GROUPS``, such as ``fsdp``), or None for the top level.
    group: Optional[str]

    def resolve(self, config: Any, ctx: SwitchContext) -> Any:
        """The switch's setting for this model and config. Raises ``UserError`` naming the keys of a combination
        that cannot work."""

    def describe(self, setting: Any, vocab_size: Optional[int]) -> str:
        """The value of its ``tune validate`` line (``vocab_size``: the model's, None when unknown)."""

    def check_device(self, setting: Any, device: torch.device) -> None:
        """Raise ``UnavailableError`` (one line naming the key) when the setting cannot run on ``device``, the
        device the run found (``device: auto`` on a machine without CUDA is a CPU run)."""

    def apply_to_model(self, model: nn.Module, setting: Any) -> None:
        """Change the model in place before it is sharded (activation checkpointing)."""

    def shard_options(self, setting: Any) -> Mapping[str, Any]:
        """Keyword arguments for every ``fully_shard`` call (``offload_policy``); any makes a single process shard
        its model too, on a world of one."""

    def wrap_optimizer(self, setting: Any, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        """The factory the run builds its optimizers with (``make_optimizer`` itself, or one that also tells the
        user what the optimizer does at its first step)."""

    def build_stepper(self, setting: Any, make_optimizer: MakeOptimizer, model: nn.Module) -> Optional[Any]:
        """The ``training.step.Stepper`` of the model's parameters, or None to leave it to another switch (the
        default steps after backward)."""

    def objective(self, setting: Any) -> Optional[Any]:
        """The ``training.objective.Objective`` the step computes, or None for the default."""

    def planner_optimizer(self, setting: Any, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        """The optimizer the planner simulates: ``make_optimizer`` itself, or a stand-in for one whose step cannot
        run under fake tensors (``planner_cost`` then adds what the stand-in leaves out)."""

    def planner_cost(self, setting: Any, sizes: ModelSizes) -> SwitchCost:
        """What the simulated step does not show (see ``SwitchCost``); the planner asks the switches in order, each
        seeing the estimate with the earlier ones' costs (``sizes.so_far``)."""

    def alternatives(self, setting: Any) -> list[Alternative]:
        """Settings worth estimating when nothing fits, each with a label such as ``loss_chunks=8``."""

    def resume_record(self, setting: Any) -> Mapping[str, Any]:
        """What a resume must keep of this setting (recorded in the checkpoint, compared on resume); empty when
        the setting can change between a run and its resume."""


class SwitchDefaults:
    """The do-nothing answers of ``MemorySwitch``, for a switch to inherit those it does not need."""

    group: Optional[str] = None

    def check_device(self, setting: Any, device: torch.device) -> None:
        return None

    def apply_to_model(self, model: nn.Module, setting: Any) -> None:
        return None

    def shard_options(self, setting: Any) -> Mapping[str, Any]:
        return {}

    def wrap_optimizer(self, setting: Any, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        return make_optimizer

    def build_stepper(self, setting: Any, make_optimizer: MakeOptimizer, model: nn.Module) -> Optional[Any]:
        return None

    def objective(self, setting: Any) -> Optional[Any]:
        return None

    def planner_optimizer(self, setting: Any, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        return make_optimizer

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
    for switch in found:
        if switch.group is not None and switch.group not in KEY_GROUPS:
            raise RuntimeError(f"memory switch {switch.name}: its keys' group {switch.group!r} is not one of {KEY_GROUPS}")
    return tuple(sorted(found, key=lambda s: (s.order, s.name)))
