"""The validation loss: the objective's mean over every target of a held-out dataset, with no gradients and
dropout off, the same on 1 and N processes (each rank sums its share, one all-reduce adds them up). An objective
with metrics of its own (DPO's reward accuracy) has them averaged over the same targets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import nn

from torchtune_ac.runtime.distributed import DistributedContext, all_reduce_sum
from torchtune_ac.training.objective import Objective, split_loss
from torchtune_ac.training.step import CROSS_ENTROPY, move_batch


@dataclass(frozen=True)
class Evaluation:
    """A validation pass's global means per target: the loss, and the objective's metrics by name."""

    loss: float
    metrics: Mapping[str, float]


@torch.no_grad()
def evaluate_objective(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    ctx: DistributedContext,
    objective: Objective = CROSS_ENTROPY,
) -> Evaluation:
    """The mean loss (and metrics) per target over ``batches`` (this rank's; every rank calls this with as many
    batches).

    The model is put in eval mode (no dropout) for the pass and back in the mode it was in. Sums are kept in
    float64, so the mean does not depend on how the samples were split over ranks beyond float32 rounding of
    each micro-batch's sum.

    Returns:
        The global means, NaN when no batch holds a target.
    """
    was_training = model.training
    model.eval()
    names = tuple(objective.metric_names)
    try:
        totals = torch.zeros(2 + len(names), dtype=torch.float64, device=ctx.device)  # loss, targets, metrics...
        for batch in batches:
            batch = move_batch(batch, ctx.device)
            loss, metrics = split_loss(objective(model, batch))
            totals[0] += loss.double()
            totals[1] += objective.targets(batch)
            if metrics is not None:
                totals[2:] += metrics[:len(names)].double()  # not the objective's counts
        totals = all_reduce_sum(totals, ctx)
    finally:
        model.train(was_training)
    loss, targets, *metrics = totals.tolist()
    mean = (lambda total: total / targets) if targets else (lambda total: float("nan"))
    return Evaluation(mean(loss), {name: mean(total) for name, total in zip(names, metrics)})


def evaluate(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    ctx: DistributedContext,
    objective: Objective = CROSS_ENTROPY,
) -> float:
    """The mean loss per target over ``batches`` (see ``evaluate_objective``), or NaN when none holds a target."""
    return evaluate_objective(model, batches, ctx=ctx, objective=objective).loss
