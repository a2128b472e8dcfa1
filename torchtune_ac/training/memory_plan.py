"""The memory switches, resolved in one place: activation checkpointing, the optimizer step in backward, and
the chunked loss. ``resolve_memory_plan`` turns the config keys and the model into a ``MemoryPlan``, a frozen
value that the recipe's step follows, ``tune validate`` prints, and the memory planner estimates.

    optimizer_in_bwd: false | true     # step each parameter in backward; its gradient is freed at once
    loss_chunks: null | N              # N > 1: project and score the targets N chunks at a time

``loss_chunks: null`` (the default) chooses from the vocabulary: ``DEFAULT_LOSS_CHUNKS`` chunks when it has at
least ``CHUNKED_LOSS_MIN_VOCAB`` tokens (the logits then outweigh everything else a step keeps), else the
whole logits (see the README's "Fitting a bigger model" for the measurements behind this).

``ac_mode: auto`` is resolved here too, last, once the other switches are known: the memory planner
(``training/planner.py``) estimates the plans from the least recompute to the most, and the first whose
estimate fits ``ac_memory_budget_gib`` wins.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import family_of, transformer_blocks
from torchtune_ac.training.activation_checkpointing import ACConfig, ACPlan
from torchtune_ac.training.planner import GiB, MemoryEstimate, Workload, choose_plan

DEFAULT_LOSS_CHUNKS = 8
CHUNKED_LOSS_MIN_VOCAB = 32_000
# ac_mode: auto without a budget, on CUDA: the device's memory minus this share (the CUDA context, the
# collectives' buffers and the caching allocator's fragmentation are not in the estimate).
CUDA_BUDGET_MARGIN = 0.10


@dataclass(frozen=True)
class MemoryConfig:
    """The memory switches besides activation checkpointing (top-level config keys)."""

    # Step each parameter's optimizer in backward, as soon as its gradient is final, and free the gradient.
    optimizer_in_bwd: bool = False
    # Chunks of the output projection + cross-entropy; null: DEFAULT_LOSS_CHUNKS for large vocabularies, else 1.
    loss_chunks: Optional[int] = field(default=None, metadata={"minimum": 1})


@dataclass(frozen=True)
class MemoryPlan:
    """What a training step does to save memory.

    Attributes:
        ac: which blocks are checkpointed, and how.
        optimizer_in_backward: each parameter is stepped in backward and its gradient freed at once.
        loss_chunks: 1 for the whole logits, else the number of chunks of the loss.
        vocab_size: the vocabulary the loss projects to (None when the model's family is unknown).
        budget_gib: with ``ac_mode: auto``, the budget the AC plan was chosen for (per process).
        estimate: with ``ac_mode: auto``, the chosen plan's memory estimate.
    """

    ac: ACPlan
    optimizer_in_backward: bool
    loss_chunks: int
    vocab_size: Optional[int] = None
    budget_gib: Optional[float] = None
    estimate: Optional[MemoryEstimate] = None

    def describe(self) -> list[tuple[str, str]]:
        """``(label, value)`` lines for ``tune validate`` and the recipe's log."""
        vocab = f" (vocabulary {self.vocab_size:,})" if self.vocab_size else ""
        if self.loss_chunks > 1:
            loss = (f"{self.loss_chunks} chunks{vocab}: targets only, each chunk's gradients computed as it "
                    "goes (nothing recomputed in backward), never the whole logits")
        else:
            loss = f"whole logits{vocab}"
        step = ("in backward: each parameter stepped as its gradient is ready, gradients freed at once"
                if self.optimizer_in_backward else "after backward")
        ac = str(self.ac)
        if self.estimate is not None:
            ac = (f"auto -> {ac} (the least recompute that fits: estimated {self.estimate.total / GiB:.2f} GiB of "
                  f"{self.budget_gib:g} GiB per process)")
        return [("activation checkpointing", ac), ("optimizer step", step), ("loss", loss)]


def takes_output_head(model: nn.Module) -> bool:
    """Whether the model's forward accepts ``head=`` (the chunked loss runs through it)."""
    return "head" in inspect.signature(model.forward).parameters


def _vocab_size(model: nn.Module) -> Optional[int]:
    family = family_of(model)
    return None if family is None else family.hf.architecture(family.args_of(model))["vocab_size"]


@dataclass(frozen=True)
class PlanningInputs:
    """What ``ac_mode: auto`` needs to estimate a plan's memory.

    Attributes:
        build_model: builds the model on the current default device (the planner calls it under fake tensors).
        make_optimizer: the config's optimizer, called with parameters.
        workload: one process's step (its ``optimizer_in_bwd`` and ``loss_chunks`` are filled in here).
        device: where the run trains (on CUDA, an unset budget is the device's memory minus a margin).
    """

    build_model: Callable[[], nn.Module]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    workload: Workload
    device: torch.device


def budget_gib(ac: ACConfig, device: torch.device) -> float:
    """The memory per process an auto plan must fit in: ``ac_memory_budget_gib``, else (CUDA) the device's memory
    minus ``CUDA_BUDGET_MARGIN``.

    Raises:
        UserError: no budget on a CPU (there is no device memory to read).
    """
    if ac.ac_memory_budget_gib is not None:
        return ac.ac_memory_budget_gib
    if device.type != "cuda":
        raise UserError(
            f"ac_mode=auto on {device.type}: set ac_memory_budget_gib, the memory per process the run must fit in "
            "(on CUDA it defaults to the device's memory minus 10 %)"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    return total * (1 - CUDA_BUDGET_MARGIN) / GiB


def resolve_memory_plan(
    ac: ACConfig,
    memory: MemoryConfig,
    model: nn.Module,
    *,
    clip_grad_norm: Optional[float],
    planning: Optional[PlanningInputs] = None,
) -> MemoryPlan:
    """Resolve the memory switches for ``model`` (built, or on the meta device).

    Args:
        ac: the activation-checkpointing keys.
        memory: ``optimizer_in_bwd`` and ``loss_chunks``.
        model: the model the run trains.
        clip_grad_norm: the config's value (clipping needs the total norm before any parameter is stepped).
        planning: what ``ac_mode: auto`` needs to estimate memory (required with auto only).

    Returns:
        The plan.

    Raises:
        UserError: one line naming the keys of a combination that cannot work: ``optimizer_in_bwd`` with
            ``clip_grad_norm``, or ``loss_chunks`` > 1 for a model whose forward takes no output head; ``ac_mode:
            auto`` with no budget on a CPU, or with no plan that fits (saying how much is missing and what would
            close the gap); and the AC problems of ``ACConfig.resolve``.
    """
    n_layers = len(transformer_blocks(model))
    plan = None if ac.is_auto else ac.resolve(n_layers)
    if memory.optimizer_in_bwd and clip_grad_norm is not None:
        raise UserError(
            f"optimizer_in_bwd=true with clip_grad_norm={clip_grad_norm}: in backward each parameter is updated as "
            "soon as its gradient is ready, before the total norm that clipping scales by is known; set "
            "clip_grad_norm: null, or optimizer_in_bwd: false"
        )
    vocab_size = _vocab_size(model)
    chunks = memory.loss_chunks
    if chunks is None:
        chunks = DEFAULT_LOSS_CHUNKS if vocab_size is not None and vocab_size >= CHUNKED_LOSS_MIN_VOCAB else 1
    if chunks > 1 and not takes_output_head(model):
        raise UserError(
            f"loss_chunks={chunks}: the chunked loss runs through the model's output head, and "
            f"{type(model).__name__}.forward takes no `head` argument; set loss_chunks: 1"
        )
    if plan is not None:
        return MemoryPlan(ac=plan, optimizer_in_backward=memory.optimizer_in_bwd, loss_chunks=chunks,
                          vocab_size=vocab_size)
    if planning is None:
        raise ValueError("ac_mode=auto needs PlanningInputs to estimate the plans' memory")
    budget = budget_gib(ac, planning.device)
    workload = dataclasses.replace(planning.workload, optimizer_in_bwd=memory.optimizer_in_bwd, loss_chunks=chunks,
                                   clip_grad_norm=clip_grad_norm)
    estimate = choose_plan(planning.build_model, planning.make_optimizer, workload, budget, n_layers)
    return MemoryPlan(ac=estimate.plan, optimizer_in_backward=memory.optimizer_in_bwd, loss_chunks=chunks,
                      vocab_size=vocab_size, budget_gib=budget, estimate=estimate)
