"""The validation loss: the objective's mean over every target of a held-out dataset, with no gradients and
dropout off, the same on 1 and N processes (each rank sums its share, one all-reduce adds them up)."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from torchtune_ac.runtime.distributed import DistributedContext, all_reduce_sum
from torchtune_ac.training.objective import Objective
from torchtune_ac.training.step import CROSS_ENTROPY, move_batch


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    ctx: DistributedContext,
    objective: Objective = CROSS_ENTROPY,
) -> float:
    """The mean loss per target over ``batches`` (this rank's; every rank calls this with as many batches).

    The model is put in eval mode (no dropout) for the pass and back in the mode it was in. Sums are kept in
    float64, so the mean does not depend on how the samples were split over ranks beyond float32 rounding of
    each micro-batch's sum.

    Returns:
        The global mean, or NaN when no batch holds a target.
    """
    was_training = model.training
    model.eval()
    try:
        totals = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        for batch in batches:
            batch = move_batch(batch, ctx.device)
            totals[0] += objective(model, batch).double()
            totals[1] += objective.targets(batch)
        totals = all_reduce_sum(totals, ctx)
    finally:
        model.train(was_training)
    loss, targets = totals.tolist()
    return loss / targets if targets else float("nan")
