"""The memory features, resolved together: ``resolve_memory_plan`` turns their keys and the model into a
``MemoryPlan``, a frozen value the run applies (``run/assemble.py``), ``tune validate`` prints (``describe``) and the
memory planner estimates.

The features are listed in ``features.py``; their top-level keys are ``MemoryConfig``'s fields (``feature.py``), their
``fsdp.*`` key is ``FSDPConfig``'s (``parallel/fsdp.py``) and activation checkpointing's are ``ACConfig``'s
(``activation_checkpointing/config.py``).

``ac_mode: auto`` is resolved here too, last, once the other features are known: the memory planner
(``memory/planner/``) estimates the plans from the least recompute to the most, and the first whose estimate
fits the budget wins. With several processes only rank 0 does this, and every rank applies its choice
(``run/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtune_ac.errors import UserError
from torchtune_ac.memory import cpu_offload, optimizer_state
from torchtune_ac.memory.chunked_loss import loss_objective
from torchtune_ac.memory.feature import Feature, MakeOptimizer, MemoryConfig, OptimizerSpec, ResolveInputs
from torchtune_ac.memory.features import ACTIVATION_CHECKPOINTING, FEATURES, MemorySettings
from torchtune_ac.memory.optimizer_in_backward import build_optimizer
from torchtune_ac.memory.planner import GiB, MemoryEstimate, Workload, choose_plan
from torchtune_ac.models.families import family_of, transformer_blocks
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACPlan
from torchtune_ac.training.objective import Objective
from torchtune_ac.training.step import Stepper

# ac_mode: auto without a budget, on CUDA: this share of the device is left out of the budget, for what the
# estimate does not hold (the caching allocator's fragmentation, buffers NCCL allocates at its first collectives).
CUDA_BUDGET_MARGIN = 0.10


@dataclass(frozen=True)
class MemoryPlan:
    """What a training step does to save memory.

    Attributes:
        ac: which blocks are checkpointed, and how.
        settings: every other feature's setting (``MemorySettings``: ``settings.loss_chunks``, ...); by default
            every one off (a plan built by hand for AC alone).
        vocab_size: the vocabulary the loss projects to (None when the model's family is unknown).
        budget_gib: with ``ac_mode: auto``, the budget the AC plan was chosen for (per process).
        estimate: with ``ac_mode: auto``, the chosen plan's memory estimate.
    """

    ac: ACPlan
    settings: MemorySettings = MemorySettings()
    vocab_size: Optional[int] = None
    budget_gib: Optional[float] = None
    estimate: Optional[MemoryEstimate] = None

    def _setting_of(self, feature: Feature) -> Any:
        return self.ac if feature is ACTIVATION_CHECKPOINTING else self.settings.of(feature)

    def describe(self, *, ac: bool = True) -> list[tuple[str, str]]:
        """``(label, value)`` lines for ``tune validate`` and the run's log, in the features' order (without
        activation checkpointing's line when not ``ac``)."""
        lines = []
        for feature in FEATURES:
            if feature is ACTIVATION_CHECKPOINTING and not ac:
                continue
            value = feature.describe(self._setting_of(feature), self.vocab_size)
            if feature is ACTIVATION_CHECKPOINTING and self.estimate is not None:
                value = (f"auto -> {value} (the least recompute that fits: estimated {self.estimate.device / GiB:.2f} "
                         f"GiB of {self.budget_gib:g} GiB per process, {self.estimate.fixed / GiB:.2f} of them the "
                         "process's own)")
            lines.append((feature.label, value))
        return lines

    def check_device(self, device: torch.device) -> None:
        """Raise ``UnavailableError`` when a feature's setting cannot run on ``device`` (the run's, as resolved)."""
        for feature in FEATURES:
            feature.check_device(self._setting_of(feature), device)

    def resume_record(self) -> dict[str, Any]:
        """What a resume must keep of the features' settings."""
        record: dict[str, Any] = {}
        for feature in FEATURES:
            record.update(feature.resume_record(self._setting_of(feature)))
        return record

    # What the run applies of the plan, each by the feature it belongs to (the order: run/assemble.py).

    @property
    def offloads_activations(self) -> bool:
        """Activation offloading: what checkpointed blocks keep waits in host memory."""
        return self.settings.enable_activation_offloading

    def shard_options(self) -> dict[str, Any]:
        """CPU offload's ``fully_shard`` arguments; any means a single process shards its model too."""
        return dict(cpu_offload.shard_options(self.settings.cpu_offload))

    def wrap_optimizer(self, make_optimizer: MakeOptimizer) -> MakeOptimizer:
        """The factory the run builds its optimizers with: the optimizer state's (announcing a compiling first
        step)."""
        return optimizer_state.optimizer_factory(self.settings.optimizer_state, make_optimizer)

    def build_stepper(self, make_optimizer: MakeOptimizer, model: nn.Module,
                      mesh: Optional[DeviceMesh] = None) -> Stepper:
        """Who steps the model's parameters, built with ``wrap_optimizer``'s factory: after backward or, with
        ``optimizer_in_bwd``, in it; the gradient norm summed over ``mesh``, the run's (None: the parameters'
        own, or none). Build it after ``fully_shard``."""
        return build_optimizer(self.wrap_optimizer(make_optimizer), model, in_backward=self.settings.optimizer_in_bwd,
                               mesh=mesh)

    def objective(self, compiled: bool = False) -> Objective:
        """What the step computes: the chunked loss (its chunks compiled in a run that compiles, ``compiled``), or
        the whole-logits cross-entropy."""
        return loss_objective(self.settings.loss_chunks, compiled)


def vocab_size_of(model: nn.Module) -> Optional[int]:
    """The vocabulary a model's loss projects to (None for a model of no known family)."""
    family = family_of(model)
    return None if family is None else family.hf.architecture(family.args_of(model))["vocab_size"]


@dataclass(frozen=True)
class PlannerInputs:
    """What ``ac_mode: auto`` needs to estimate a plan's memory.

    Attributes:
        build_model: builds the model on the current default device (the planner calls it under fake tensors).
        make_optimizer: the config's optimizer, called with parameters.
        workload: one process's step (its feature settings are filled in here).
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
        fixed_bytes: the fixed cost the estimates compared with this budget include (``PlannerInputs``).

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
    memory: MemoryConfig,
    model: nn.Module,
    *,
    clip_grad_norm: Optional[float],
    planning: Optional[PlannerInputs] = None,
    fsdp: Optional[FSDPConfig] = None,
    optimizer: Optional[OptimizerSpec] = None,
    dtype: torch.dtype = torch.float32,
    device: str = "auto",
) -> MemoryPlan:
    """Resolve the memory features for ``model`` (built, or on the meta device), in ``FEATURES`` order.

    Args:
        ac: the activation-checkpointing keys.
        memory: the other features' top-level keys.
        model: the model the run trains.
        clip_grad_norm: the config's value (clipping needs the total norm before any parameter is stepped).
        planning: what ``ac_mode: auto`` needs to estimate memory (required with auto only).
        fsdp: the ``fsdp.*`` keys (None: their defaults).
        optimizer: the config's optimizer (None: a plan for AC and the step alone, as tests build them).
        dtype: the parameters' storage dtype.
        device: the config's ``device`` value (``auto``, ``cpu``, ``cuda``).

    Returns:
        The plan.

    Raises:
        UserError: one line naming the keys of a combination that cannot work (each feature's ``resolve``);
            ``ac_mode: auto`` with no budget on a CPU, or with no plan that fits (saying how much is missing and
            what would close the gap); and the AC problems of ``ACConfig.resolve``.
    """
    vocab_size = vocab_size_of(model)
    settings: dict[str, Any] = {}
    for feature in FEATURES:
        inputs = ResolveInputs(ac=ac, memory=memory, fsdp=fsdp if fsdp is not None else FSDPConfig(), model=model,
                               vocab_size=vocab_size, clip_grad_norm=clip_grad_norm, settings=dict(settings),
                               optimizer=optimizer, dtype=dtype, device=device)
        settings[feature.name] = feature.resolve(inputs)
    ac_plan = settings.pop(ACTIVATION_CHECKPOINTING.name)
    typed = MemorySettings(**settings)
    if ac_plan is not None:
        return MemoryPlan(ac=ac_plan, settings=typed, vocab_size=vocab_size)
    if planning is None:
        raise ValueError("ac_mode=auto needs PlannerInputs to estimate the plans' memory")
    budget = budget_gib(ac, planning.device, planning.fixed_bytes)
    workload = planning.workload.with_settings(typed, clip_grad_norm=clip_grad_norm)
    estimate = choose_plan(planning.build_model, planning.make_optimizer, workload, budget,
                           len(transformer_blocks(model)), planning.fixed_bytes, planning.device)
    return MemoryPlan(ac=estimate.plan, settings=typed, vocab_size=vocab_size, budget_gib=budget,
                      estimate=estimate)
