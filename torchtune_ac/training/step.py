"""One optimizer step over ``gradient_accumulation_steps`` micro-batches, on 1 or N processes.

The loss of a step is the mean token cross-entropy over every target token of every micro-batch on every
rank. Each micro-batch's summed loss is divided by that global count before backward, so the gradient is
the same whether a global batch is split over more ranks, more micro-batches, or neither (FSDP averages
gradients over ranks, hence the factor ``world_size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtune_ac.training.distributed import DistributedContext, all_reduce_sum
from torchtune_ac.training.loss import count_target_tokens, cross_entropy_sum


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did (values are global: summed or averaged over all ranks)."""

    loss: float
    grad_norm: float
    input_tokens: int
    target_tokens: int


def move_batch(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    ctx: DistributedContext,
    clip_grad_norm: Optional[float] = None,
) -> StepResult:
    """Forward/backward every micro-batch, clip, and step the optimizer.

    Args:
        model: the (possibly FSDP-sharded, possibly checkpointed) model.
        optimizer: its optimizer; gradients are zeroed after the step.
        micro_batches: dicts with ``tokens`` and ``labels`` ``[b, s]`` (and optionally ``document_ids``), on the device.
        ctx: rank / world size.
        clip_grad_norm: max total gradient norm, or None to only measure it.

    Returns:
        The global mean loss, the gradient norm before clipping, and token counts.
    """
    local_targets = sum(count_target_tokens(batch["labels"]) for batch in micro_batches)
    local_inputs = sum(batch["tokens"].numel() for batch in micro_batches)
    counts = all_reduce_sum(torch.stack([local_targets.cpu(), torch.tensor(local_inputs)]).to(ctx.device), ctx)
    global_targets = max(int(counts[0]), 1)
    scale = ctx.world_size / global_targets

    loss_sum = torch.zeros((), device=ctx.device)
    for batch in micro_batches:
        logits = model(batch["tokens"], batch.get("document_ids"))
        micro_loss = cross_entropy_sum(logits, batch["labels"])
        (micro_loss * scale).backward()
        loss_sum += micro_loss.detach()
        del logits, micro_loss

    grad_norm = torch.nn.utils.clip_grad_norm_(
        model.parameters(), max_norm=clip_grad_norm if clip_grad_norm is not None else math.inf
    )
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total_loss = all_reduce_sum(loss_sum, ctx)
    return StepResult(
        loss=float(total_loss) / global_targets,
        grad_norm=float(grad_norm),
        input_tokens=int(counts[1]),
        target_tokens=int(counts[0]),
    )
