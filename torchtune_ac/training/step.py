"""One optimizer step over ``gradient_accumulation_steps`` micro-batches, on 1 or N processes.

The loss of a step is the objective's mean over every target of every micro-batch on every rank. Each
micro-batch's summed loss is divided by that global count before backward, so the gradient is the same whether
a global batch is split over more ranks, more micro-batches, or neither (FSDP averages gradients over ranks,
hence the factor ``world_size``).

Two things vary, and each is a value passed in, never a type tested here:

- the ``Objective`` (``objective.py``): how a micro-batch's summed loss is computed (whole logits by default;
  the chunked loss switch gives another);
- the ``Stepper``: who steps the parameters, and when. ``OptimizerStepper`` clips and steps after the last
  backward; the optimizer-in-backward switch's stepper has stepped every parameter by then, in backward.

``train_step`` stops a step whose loss or gradient norm is not finite before the optimizer takes it in
(``runtime/non_finite.py``), and synchronises the host with the device once per optimizer step, for that check
and the values it reports together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtune_ac.runtime.distributed import DistributedContext, all_reduce_sum
from torchtune_ac.runtime.non_finite import FiniteChecks, StepValues
from torchtune_ac.training.gradient_norm import GradientNorm
from torchtune_ac.training.objective import (
    HOST_KEYS,
    CrossEntropy,
    LossParts,
    Objective,
    count_target_tokens,
    metric_count_shapes,
    split_loss,
)

CROSS_ENTROPY = CrossEntropy()
# check_norm(norm, stepped): sees the step's total gradient norm; ``stepped`` when the parameters already took it.
NormCheck = Callable[..., None]


class Stepper(Protocol):
    """Who steps the parameters, and when (see the module docstring).

    Attributes:
        optimizer: the optimizer an LR scheduler drives (its ``param_groups`` set every step's learning rate).
    """

    optimizer: torch.optim.Optimizer

    def begin_micro_batch(self, *, final: bool) -> None:
        """Called before each micro-batch's forward; ``final`` for the last of the step."""

    def update(self, model: nn.Module, clip_grad_norm: Optional[float],
               check_norm: Optional[NormCheck] = None) -> torch.Tensor:
        """After the last backward: make sure every parameter took its step, and free the gradients. No host
        synchronisation of its own.

        Args:
            model: the model whose gradients are final.
            clip_grad_norm: max total norm, or None to only measure it.
            check_norm: called with the total norm and ``stepped=`` (whether the parameters already took it)
                before the parameters are stepped, where that is still possible; it may raise.

        Returns:
            The step's total gradient norm before clipping (a 0-d tensor).
        """

    def optimizers_to_checkpoint(self) -> list[torch.optim.Optimizer]:
        """The optimizers whose state a checkpoint holds."""


class OptimizerStepper:
    """Steps ``optimizer`` once after backward, after clipping (the ordinary step).

    Args:
        optimizer: over the model's (sharded) parameters.
        mesh: the run's device mesh, over which the gradient norm is summed (``GradientNorm``); None: the one the
            parameters are sharded over, or none.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, mesh: Optional[DeviceMesh] = None) -> None:
        self.optimizer = optimizer
        self.gradient_norm = GradientNorm((p for group in optimizer.param_groups for p in group["params"]), mesh)

    def begin_micro_batch(self, *, final: bool) -> None:
        return None

    def update(self, model: nn.Module, clip_grad_norm: Optional[float],
               check_norm: Optional[NormCheck] = None) -> torch.Tensor:
        norm = self.gradient_norm.clip_(model.parameters(), clip_grad_norm)
        if check_norm is not None:
            check_norm(norm, stepped=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def optimizers_to_checkpoint(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (values are global: summed or averaged over all ranks).

    ``extra``: more values for the step's ``metrics.jsonl`` record, a recipe's own (its objective's metrics, each
    averaged over the step's targets as the loss is). ``counts``: its objective's counts over the step (nested
    lists of the shapes of its ``count_shapes``: the tokens each expert received), for ``metrics.jsonl`` only.
    """

    loss: float
    grad_norm: float
    input_tokens: int
    target_tokens: int
    extra: Mapping[str, float] = field(default_factory=dict)
    counts: Mapping[str, list] = field(default_factory=dict)


def move_batch(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``batch`` on ``device``, without waiting for it; the values the host counted (``objective.HOST_KEYS``) stay
    on the host, where reading them costs nothing."""
    return {key: value if key in HOST_KEYS else value.to(device, non_blocking=True) for key, value in batch.items()}


def micro_batch_loss(model: nn.Module, batch: Mapping[str, torch.Tensor],
                     objective: Objective = CROSS_ENTROPY) -> "torch.Tensor | LossParts":
    """The summed loss of one micro-batch under ``objective`` (one place that every step goes through), with the
    sums of the objective's metrics when it has some."""
    return objective(model, batch)


def accumulate_gradients(
    model: nn.Module,
    stepper: Stepper,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    scale: float | torch.Tensor,
    objective: Objective = CROSS_ENTROPY,
    after_forward: Optional[Callable[[int], None]] = None,
    record_loss: Optional[Callable[[int, torch.Tensor], None]] = None,
    metric_sums: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Forward and backward every micro-batch, each summed loss scaled by ``scale`` (a number, or a 0-d tensor on
    the device). No host synchronisation: the memory planner runs this under fake tensors, and
    ``after_forward(i)`` (called between micro-batch ``i``'s forward and backward) lets it see what a forward
    keeps. ``record_loss(i, loss)``, if given, sees micro-batch ``i``'s loss before its backward (to keep it on the
    device: reading it there would cost a synchronisation per micro-batch). ``metric_sums``, if given (float32
    ``[len(objective.metric_names)]`` on the device), has the objective's metric sums added to it.

    Returns:
        The summed (unscaled) loss of all micro-batches, detached.
    """
    loss_sum = torch.zeros((), device=micro_batches[0]["tokens"].device)
    for i, batch in enumerate(micro_batches):
        stepper.begin_micro_batch(final=i == len(micro_batches) - 1)
        micro_loss, metrics = split_loss(micro_batch_loss(model, batch, objective))
        if after_forward is not None:
            after_forward(i)
        if record_loss is not None:
            record_loss(i, micro_loss)
        if metric_sums is not None and metrics is not None:
            metric_sums += metrics
        (micro_loss * scale).backward()
        loss_sum += micro_loss.detach()
        del micro_loss, metrics
    return loss_sum


def train_step(
    model: nn.Module,
    stepper: Stepper,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    ctx: DistributedContext,
    objective: Objective = CROSS_ENTROPY,
    clip_grad_norm: Optional[float] = None,
) -> StepResult:
    """Forward/backward every micro-batch, and let the stepper step the parameters.

    The host waits for the device once (``FiniteChecks.read``): after the last backward, before the optimizer
    steps, every value the step reports and checks is read at once. The global target count that scales every
    micro-batch's loss stays on the device (an all-reduce before the first forward); the host-side values of a
    batch (``objective.HOST_KEYS``) are read on the host.

    Args:
        model: the (possibly FSDP-sharded, possibly checkpointed) model.
        stepper: who steps the parameters (gradients are freed after the step).
        micro_batches: dicts with ``tokens`` and ``labels`` ``[b, s]`` (and optionally ``document_ids``), on the
            device, and the host-side values ``collate_batch`` counted (``move_batch`` keeps them on the host).
        ctx: rank, world size, parallelism (its tensor-parallel degree).
        objective: what each micro-batch's summed loss is.
        clip_grad_norm: max total gradient norm, or None to only measure it.

    Returns:
        The global mean loss, the gradient norm before clipping, token counts, and the objective's metrics (its
        ``metric_names``), each a global mean over the targets.

    Raises:
        NonFiniteError: on every rank, a micro-batch's loss or the gradient norm is NaN or infinite (checked
            before the optimizer step, or after it where the parameters were stepped in backward).
    """
    device = micro_batches[0]["tokens"].device
    local_targets = sum(objective.targets(batch) for batch in micro_batches)
    local_inputs = sum(batch["tokens"].numel() for batch in micro_batches)
    # The target tokens apart from the targets: the same for the token loss, not for DPO's (whose targets are pairs).
    local_tokens = sum(count_target_tokens(batch["labels"]) for batch in micro_batches)
    # [targets, inputs, target tokens], summed over ranks on the device: a fill, not a copy from the host.
    counts = all_reduce_sum(torch.stack([local_targets, torch.full((), local_inputs, device=device), local_tokens]),
                            ctx)
    # world_size / targets in float64, rounded once to float32 (what multiplying by a Python float does).
    scale = (ctx.world_size / counts[0].clamp(min=1).double()).float()

    checks = FiniteChecks(ctx, len(micro_batches), device, loss_scale=objective.loss_scale)
    count_shapes = metric_count_shapes(objective)
    metric_sums = torch.zeros(len(objective.metric_names) + sum(math.prod(s) for s in count_shapes.values()),
                              device=device)
    loss_sum = accumulate_gradients(model, stepper, micro_batches, scale=scale, objective=objective,
                                    record_loss=checks.record_loss, metric_sums=metric_sums)
    read: list[StepValues] = []

    def check_norm(norm: torch.Tensor, *, stepped: bool = False) -> None:
        read.append(checks.read(loss_sum, norm, counts, stepped=stepped, metric_sums=metric_sums))

    norm = stepper.update(model, clip_grad_norm, check_norm=check_norm)
    values = read[0] if read else checks.read(loss_sum, norm, counts, stepped=True, metric_sums=metric_sums)
    targets = max(values.targets, 1)
    # The ranks of a tensor-parallel group read the same batch: the sums counted each of its tokens that many times
    # (the loss and the metrics too, and their means over the targets are right as they are).
    averaged = len(objective.metric_names)
    counted = torch.tensor(values.metric_sums[averaged:]).round().long()
    counts = {}
    for name, shape in count_shapes.items():
        counts[name], counted = counted[:math.prod(shape)].view(shape).tolist(), counted[math.prod(shape):]
    return StepResult(
        loss=values.loss_sum / targets,
        grad_norm=values.grad_norm,
        input_tokens=values.input_tokens // ctx.parallelism.tensor,
        target_tokens=values.target_tokens // ctx.parallelism.tensor,
        extra={name: total / targets for name, total in zip(objective.metric_names, values.metric_sums)},
        counts=counts,
    )
