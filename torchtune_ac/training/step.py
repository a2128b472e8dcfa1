"""One optimizer step over ``gradient_accumulation_steps`` micro-batches, on 1 or N processes.

The loss of a step is the mean token cross-entropy over every target token of every micro-batch on every
rank. Each micro-batch's summed loss is divided by that global count before backward, so the gradient is
the same whether a global batch is split over more ranks, more micro-batches, or neither (FSDP averages
gradients over ranks, hence the factor ``world_size``).

The memory plan decides how: the loss is computed from the whole logits or chunk by chunk
(``ChunkedCrossEntropy`` as the model's output head), and the optimizer steps after backward (clipping first)
or inside it (``OptimizerInBackward``, whose hooks have stepped every parameter by the end of the last
micro-batch's backward). ``train_step`` stops a step whose loss or gradient norm is not finite before the
optimizer takes it in (``non_finite.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ac.training.distributed import DistributedContext, all_reduce_sum
from torchtune_ac.training.loss import ChunkedCrossEntropy, count_target_tokens, cross_entropy_sum
from torchtune_ac.training.non_finite import FiniteChecks
from torchtune_ac.training.optimizer_in_backward import OptimizerInBackward


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (values are global: summed or averaged over all ranks)."""

    loss: float
    grad_norm: float
    input_tokens: int
    target_tokens: int


def move_batch(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def micro_batch_loss(model: nn.Module, batch: Mapping[str, torch.Tensor], loss_chunks: int = 1) -> torch.Tensor:
    """The summed float32 cross-entropy of one micro-batch: from the whole logits, or in ``loss_chunks`` chunks
    through the model's output head."""
    if loss_chunks > 1:
        return model(batch["tokens"], batch.get("document_ids"), head=ChunkedCrossEntropy(batch["labels"], loss_chunks))
    return cross_entropy_sum(model(batch["tokens"], batch.get("document_ids")), batch["labels"])


def accumulate_gradients(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    scale: float,
    loss_chunks: int = 1,
    after_forward: Optional[Callable[[int], None]] = None,
    check_loss: Optional[Callable[[int, torch.Tensor], None]] = None,
) -> torch.Tensor:
    """Forward and backward every micro-batch, each summed loss scaled by ``scale`` (an ``OptimizerInBackward``
    steps during the last one's backward). No host synchronisation: the memory planner runs this under fake
    tensors, and ``after_forward(i)`` (called between micro-batch ``i``'s forward and backward) lets it see what
    a forward keeps. ``check_loss(i, loss)``, if given, sees micro-batch ``i``'s loss before its backward (and may
    raise).

    Returns:
        The summed (unscaled) loss of all micro-batches, detached.
    """
    in_backward = isinstance(optimizer, OptimizerInBackward)
    loss_sum = torch.zeros((), device=micro_batches[0]["tokens"].device)
    for i, batch in enumerate(micro_batches):
        if in_backward:
            optimizer.begin_micro_batch(final=i == len(micro_batches) - 1)
        micro_loss = micro_batch_loss(model, batch, loss_chunks)
        if after_forward is not None:
            after_forward(i)
        if check_loss is not None:
            check_loss(i, micro_loss)
        (micro_loss * scale).backward()
        loss_sum += micro_loss.detach()
        del micro_loss
    return loss_sum


def update_parameters(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    clip_grad_norm: Optional[float] = None,
    check_norm: Optional[Callable[[torch.Tensor], None]] = None,
) -> Optional[torch.Tensor]:
    """Clip the gradients and step the optimizer, then free the gradients (no host synchronisation).
    ``check_norm(norm)``, if given, sees the total norm before the optimizer steps (and may raise).

    Returns:
        The total gradient norm before clipping (a 0-d tensor), or None for an ``OptimizerInBackward``, whose
        hooks have already stepped every parameter (it measures the norm itself).
    """
    norm = None
    if not isinstance(optimizer, OptimizerInBackward):
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm=clip_grad_norm if clip_grad_norm is not None else math.inf
        )
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        if check_norm is not None:
            check_norm(norm)
    optimizer.step()  # in backward: nothing left to do (an LR scheduler still sees the step)
    optimizer.zero_grad(set_to_none=True)
    return norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    ctx: DistributedContext,
    clip_grad_norm: Optional[float] = None,
    loss_chunks: int = 1,
) -> StepResult:
    """Forward/backward every micro-batch, clip, and step the optimizer (or let it step in backward).

    Args:
        model: the (possibly FSDP-sharded, possibly checkpointed) model.
        optimizer: its optimizer (an ``OptimizerInBackward`` steps during the last micro-batch's backward);
            gradients are freed after the step.
        micro_batches: dicts with ``tokens`` and ``labels`` ``[b, s]`` (and optionally ``document_ids``), on the device.
        ctx: rank / world size.
        clip_grad_norm: max total gradient norm, or None to only measure it (must be None in backward).
        loss_chunks: 1 for the whole logits, else the number of chunks of the loss.

    Returns:
        The global mean loss, the gradient norm before clipping, and token counts.

    Raises:
        NonFiniteError: on every rank, a micro-batch's loss (before its backward) or the gradient norm (before
            the optimizer step; with an ``OptimizerInBackward``, after its hooks stepped) is NaN or infinite.
    """
    in_backward = isinstance(optimizer, OptimizerInBackward)
    if in_backward and clip_grad_norm is not None:
        raise ValueError("clip_grad_norm cannot be applied when the optimizer steps in backward")
    local_targets = sum(count_target_tokens(batch["labels"]) for batch in micro_batches)
    local_inputs = sum(batch["tokens"].numel() for batch in micro_batches)
    counts = all_reduce_sum(torch.stack([local_targets.cpu(), torch.tensor(local_inputs)]).to(ctx.device), ctx)
    global_targets = max(int(counts[0]), 1)
    scale = ctx.world_size / global_targets

    checks = FiniteChecks(ctx, len(micro_batches))
    loss_sum = accumulate_gradients(model, optimizer, micro_batches, scale=scale, loss_chunks=loss_chunks,
                                    check_loss=checks.check_loss)
    norm = update_parameters(model, optimizer, clip_grad_norm, check_norm=checks.check_grad_norm)
    grad_norm = optimizer.finish_step(ctx.device) if in_backward else float(norm)
    if in_backward:
        checks.check_grad_norm(grad_norm, stepped=True)
    total_loss = all_reduce_sum(loss_sum, ctx)
    return StepResult(
        loss=float(total_loss) / global_targets,
        grad_norm=grad_norm,
        input_tokens=int(counts[1]),
        target_tokens=int(counts[0]),
    )
