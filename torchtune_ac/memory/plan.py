"""The memory switches, resolved in one place. ``resolve_memory_plan`` turns the config keys and the model into a
``MemoryPlan``, a frozen value that the recipe follows (``apply_to_model``, ``build_stepper``, ``objective``),
``tune validate`` prints (``describe``) and the memory planner estimates.

The switches are declared in ``memory/switches/`` (one module each, see ``memory/switch.py``); this module
iterates over them and names none. Activation checkpointing's keys are ``ACConfig`` (the schema's ``ac`` group,
validated as one by the AC module's rules); every other switch's keys are fields of a class made here from the
switches' own config classes: ``MemoryConfig`` for the top-level keys, ``FSDPConfig`` (FSDP2's own settings,
``runtime.distributed.FSDPConfig``, and the switches' ``fsdp.*`` keys) for those of a switch whose ``group`` is
``fsdp``.

``ac_mode: auto`` is resolved here too, last, once the other switches are known: the memory planner
(``memory/planner.py``) estimates the plans from the least recompute to the most, and the first whose estimate
fits ``ac_memory_budget_gib`` wins.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.memory.activation_checkpointing import ACConfig, ACPlan
from torchtune_ac.memory.planner import GiB, MemoryEstimate, Workload, choose_plan
from torchtune_ac.memory.switch import MakeOptimizer, MemorySwitch, OptimizerSpec, SwitchContext, discover_switches
from torchtune_ac.models.families import family_of, transformer_blocks
from torchtune_ac.runtime import distributed
from torchtune_ac.training.objective import Objective
from torchtune_ac.training.step import CROSS_ENTROPY, OptimizerStepper, Stepper

# ac_mode: auto without a budget, on CUDA: this share of the device is left out of the budget, for what the
# estimate does not hold (the caching allocator's fragmentation, buffers NCCL allocates at its first collectives).
CUDA_BUDGET_MARGIN = 0.10

SWITCHES: tuple[MemorySwitch, ...] = discover_switches()
AC_SWITCH = next(switch for switch in SWITCHES if switch.config_class is ACConfig)
OTHER_SWITCHES = tuple(switch for switch in SWITCHES if switch is not AC_SWITCH)


def _keys_config_class(name: str, group: Optional[str], base: Optional[type], doc: str) -> type:
    """A frozen dataclass of the keys of every switch besides AC whose ``group`` is ``group`` (after ``base``'s)."""
    fields = []
    for switch in OTHER_SWITCHES:
        if switch.group != group:
            continue
        hints = typing.get_type_hints(switch.config_class)
        for f in dataclasses.fields(switch.config_class):
            fields.append((f.name, hints[f.name], dataclasses.field(default=f.default, metadata=f.metadata)))
    names = [n for n, _, _ in fields] + ([f.name for f in dataclasses.fields(base)] if base is not None else [])
    if len(set(names)) != len(names):
        raise RuntimeError(f"two memory switches (or a switch and {name}) declare the same config key: {sorted(names)}")
    cls = dataclasses.make_dataclass(name, fields, bases=(base,) if base is not None else (), frozen=True,
                                     namespace={"__doc__": doc})
    cls.__module__ = __name__
    return cls


MemoryConfig = _keys_config_class(
    "MemoryConfig", None, None,
    "The memory switches' config keys besides activation checkpointing (top-level keys), one field per key that a "
    "switch in memory/switches/ declares.")
FSDPConfig = _keys_config_class(
    "FSDPConfig", "fsdp", distributed.FSDPConfig,
    "The fsdp.* keys: FSDP2's own settings (runtime.distributed.FSDPConfig) and those of the memory switches whose "
    "group is fsdp.")


def switch_config(switch: MemorySwitch, ac: ACConfig, memory: Any, fsdp: Any = None) -> Any:
    """The switch's own config value: ``ac`` for activation checkpointing, else its keys read from ``memory`` (or
    from ``fsdp`` for a switch whose keys are ``fsdp.*``; None: their defaults)."""
    if switch is AC_SWITCH:
        return ac
    source = fsdp if switch.group == "fsdp" else memory
    if source is None:
        return switch.config_class()
    return switch.config_class(**{f.name: getattr(source, f.name) for f in dataclasses.fields(switch.config_class)})


@dataclass(frozen=True)
class MemoryPlan:
    """What a training step does to save memory.

    Attributes:
        ac: which blocks are checkpointed, and how.
        settings: every other switch's setting, by ``SWITCH.name`` (``optimizer_in_bwd``, ``loss_chunks``, ...);
            a switch left out has its ``off`` setting (a plan built by hand for AC alone).
        vocab_size: the vocabulary the loss projects to (None when the model's family is unknown).
        budget_gib: with ``ac_mode: auto``, the budget the AC plan was chosen for (per process).
        estimate: with ``ac_mode: auto``, the chosen plan's memory estimate.
    """

    ac: ACPlan
    settings: Mapping[str, Any]
    vocab_size: Optional[int] = None
    budget_gib: Optional[float] = None
    estimate: Optional[MemoryEstimate] = None

    def setting(self, name: str) -> Any:
        """The setting of the switch called ``name``."""
        if name == AC_SWITCH.name:
            return self.ac
        switch = next((s for s in OTHER_SWITCHES if s.name == name), None)
        if switch is None:
            raise KeyError(f"no memory switch is called {name!r}")
        return self.settings.get(name, switch.off)

    def switch_settings(self) -> list[tuple[MemorySwitch, Any]]:
        """Every switch with its setting, in the switches' order."""
        return [(switch, self.setting(switch.name)) for switch in SWITCHES]

    def describe(self, *, ac: bool = True) -> list[tuple[str, str]]:
        """``(label, value)`` lines for ``tune validate`` and the recipe's log (without activation checkpointing's
        line when not ``ac``)."""
        lines = []
        for switch, setting in self.switch_settings():
            if switch is AC_SWITCH and not ac:
                continue
            value = switch.describe(setting, self.vocab_size)
            if switch is AC_SWITCH and self.estimate is not None:
                value = (f"auto -> {value} (the least recompute that fits: estimated {self.estimate.device / GiB:.2f} "
                         f"GiB of {self.budget_gib:g} GiB per process, {self.estimate.fixed / GiB:.2f} of them the "
                         "process's own)")
            lines.append((switch.label, value))
        return lines

    def check_device(self, device: torch.device) -> None:
        """Raise ``UnavailableError`` when a switch's setting cannot run on ``device`` (the run's, as resolved)."""
        for switch, setting in self.switch_settings():
            switch.check_device(setting, device)

    def apply_to_model(self, model: nn.Module) -> None:
        """Apply every switch that changes the model (before it is sharded)."""
        for switch, setting in self.switch_settings():
            switch.apply_to_model(model, setting)

    def shard_options(self) -> dict[str, Any]:
        """The switches' keyword arguments for ``fully_shard``; any means a single process shards its model too."""
        options: dict[str, Any] = {}
        for switch, setting in self.switch_settings():
            options.update(switch.shard_options(setting))
        return options

    def wrap_optimizer(self, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        """The factory the run builds its optimizers with, as the switches wrap it."""
        for switch, setting in self.switch_settings():
            make_optimizer = switch.wrap_optimizer(setting, make_optimizer)
        return make_optimizer

    def build_stepper(self, make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                      model: nn.Module) -> Stepper:
        """Who steps the model's parameters: the one switch that says so, else the optimizer after backward.
        Build it after ``fully_shard``."""
        make_optimizer = self.wrap_optimizer(make_optimizer)
        for switch, setting in self.switch_settings():
            stepper = switch.build_stepper(setting, make_optimizer, model)
            if stepper is not None:
                return stepper
        return OptimizerStepper(make_optimizer(model.parameters()))

    def objective(self) -> Objective:
        """What the step computes: the one switch that says so, else the whole-logits cross-entropy."""
        for switch, setting in self.switch_settings():
            objective = switch.objective(setting)
            if objective is not None:
                return objective
        return CROSS_ENTROPY

    def resume_record(self) -> dict[str, Any]:
        """What a resume must keep of the switches' settings."""
        record: dict[str, Any] = {}
        for switch, setting in self.switch_settings():
            record.update(switch.resume_record(setting))
        return record


def vocab_size_of(model: nn.Module) -> Optional[int]:
    """The vocabulary a model's loss projects to (None for a model of no known family)."""
    family = family_of(model)
    return None if family is None else family.hf.architecture(family.args_of(model))["vocab_size"]


@dataclass(frozen=True)
class PlanningInputs:
    """What ``ac_mode: auto`` needs to estimate a plan's memory.

    Attributes:
        build_model: builds the model on the current default device (the planner calls it under fake tensors).
        make_optimizer: the config's optimizer, called with parameters.
        workload: one process's step (its switch settings are filled in here).
        device: where the run trains (on CUDA, an unset budget is the device's free memory less a margin).
        fixed_bytes: the process's own cost on that device, measured when the run starts (what fits includes it).
    """

    build_model: Callable[[], nn.Module]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    workload: Workload
    device: torch.device
    fixed_bytes: int = 0


def budget_gib(ac: ACConfig, device: torch.device, fixed_bytes: int = 0) -> float:
    """The memory per process an auto plan must fit in: ``ac_memory_budget_gib``, else (CUDA) what the device has
    for this process: the memory free now (``torch.cuda.mem_get_info``: the CUDA context, the communicators'
    buffers, the caching allocator's reserve and other processes' memory are not in it), plus what the estimate
    already counts as held (``fixed_bytes``, the process's fixed cost: counted once, in the estimate), less
    ``CUDA_BUDGET_MARGIN`` of the device.

    Args:
        fixed_bytes: the fixed cost the estimates compared with this budget include (``PlanningInputs``).

    Raises:
        UserError: no budget on a CPU (there is no device memory to read).
    """
    if ac.ac_memory_budget_gib is not None:
        return ac.ac_memory_budget_gib
    if device.type != "cuda":
        raise UserError(
            f"ac_mode=auto on {device.type}: set ac_memory_budget_gib, the memory per process the run must fit in "
            "(on CUDA it defaults to the device's free memory, less 10 % of the device)"
        )
    free, total = torch.cuda.mem_get_info(device)
    return (free + fixed_bytes - CUDA_BUDGET_MARGIN * total) / GiB


def resolve_memory_plan(
    ac: ACConfig,
    memory: Any,
    model: nn.Module,
    *,
    clip_grad_norm: Optional[float],
    planning: Optional[PlanningInputs] = None,
    fsdp: Any = None,
    optimizer: Optional[OptimizerSpec] = None,
    dtype: torch.dtype = torch.float32,
    device: str = "auto",
) -> MemoryPlan:
    """Resolve the memory switches for ``model`` (built, or on the meta device).

    Args:
        ac: the activation-checkpointing keys.
        memory: the other switches' top-level keys (a ``MemoryConfig``).
        model: the model the run trains.
        clip_grad_norm: the config's value (clipping needs the total norm before any parameter is stepped).
        planning: what ``ac_mode: auto`` needs to estimate memory (required with auto only).
        fsdp: the ``fsdp.*`` keys (an ``FSDPConfig``; None: their defaults).
        optimizer: the config's optimizer (None: a plan for AC and the step alone, as tests build them).
        dtype: the parameters' storage dtype.
        device: the config's ``device`` value (``auto``, ``cpu``, ``cuda``).

    Returns:
        The plan.

    Raises:
        UserError: one line naming the keys of a combination that cannot work (each switch's ``resolve``);
            ``ac_mode: auto`` with no budget on a CPU, or with no plan that fits (saying how much is missing and
            what would close the gap); and the AC problems of ``ACConfig.resolve``.
    """
    vocab_size = vocab_size_of(model)
    settings: dict[str, Any] = {}
    for switch in SWITCHES:
        ctx = SwitchContext(model=model, vocab_size=vocab_size, clip_grad_norm=clip_grad_norm, settings=dict(settings),
                            optimizer=optimizer, dtype=dtype, device=device)
        settings[switch.name] = switch.resolve(switch_config(switch, ac, memory, fsdp), ctx)
    ac_plan = settings.pop(AC_SWITCH.name)
    if ac_plan is not None:
        return MemoryPlan(ac=ac_plan, settings=settings, vocab_size=vocab_size)
    if planning is None:
        raise ValueError("ac_mode=auto needs PlanningInputs to estimate the plans' memory")
    budget = budget_gib(ac, planning.device, planning.fixed_bytes)
    workload = planning.workload.with_settings(settings, clip_grad_norm=clip_grad_norm)
    estimate = choose_plan(planning.build_model, planning.make_optimizer, workload, budget,
                           len(transformer_blocks(model)), planning.fixed_bytes, planning.device)
    return MemoryPlan(ac=estimate.plan, settings=settings, vocab_size=vocab_size, budget_gib=budget,
                      estimate=estimate)
