"""Stop a step whose loss or gradient norm is not finite, before the optimizer takes it in.

A loss that turns NaN or infinite at hour 20 would otherwise be stepped into the weights, and the next
checkpoint would save them. Checked, on every rank together (each check is one all-reduce, so every rank raises
at the same point and none waits in a collective for another):

- each micro-batch's loss, after its forward and before its backward: a non-finite loss never reaches a
  gradient, in either optimizer mode, and the error names the micro-batch and the ranks that saw it;
- the step's total gradient norm (every micro-batch's loss finite, but a gradient overflowed): after backward
  and clipping, before ``optimizer.step()``, so the weights are untouched. With the optimizer step in backward
  the parameters are stepped inside backward, before the total norm exists: the run still stops at the end of
  that step and the stepped state is never saved (checking each parameter's gradient in its hook would cost a
  host synchronisation per parameter on GPUs).

The recipe turns ``NonFiniteError`` into a stop that saves nothing, so the newest checkpoint stays the last good one.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from torchtune_ac.runtime.distributed import DistributedContext, all_reduce_sum


class NonFiniteError(Exception):
    """A loss or gradient norm that is NaN or infinite (raised on every rank at the same point).

    Attributes:
        what: ``"loss"`` or ``"gradient norm"``.
        value: the first non-finite value seen.
        micro_batch: the 0-based micro-batch whose loss it is (None for the gradient norm).
        micro_batches: micro-batches per step.
        ranks: the ranks that saw a non-finite loss (all ranks for the gradient norm, which is global).
        stepped: the parameters were already stepped in backward (the gradient norm with optimizer_in_bwd).
    """

    def __init__(self, what: str, value: float, *, micro_batch: Optional[int], micro_batches: int,
                 ranks: Sequence[int], stepped: bool = False) -> None:
        self.what, self.value, self.micro_batch = what, value, micro_batch
        self.micro_batches, self.ranks, self.stepped = micro_batches, list(ranks), stepped
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.micro_batch is None:
            where = f"every one of the {self.micro_batches} micro-batch loss(es) was finite"
            return f"the gradient norm is {self.value} ({where})"
        ranks = ", ".join(str(r) for r in self.ranks)
        return (f"the loss of micro-batch {self.micro_batch + 1} of {self.micro_batches} is {self.value} "
                f"(rank{'s' if len(self.ranks) > 1 else ''} {ranks})")


class FiniteChecks:
    """The checks of one optimizer step (see the module docstring); every rank calls them at the same points."""

    def __init__(self, ctx: DistributedContext, micro_batches: int) -> None:
        self.ctx = ctx
        self.micro_batches = micro_batches

    def check_loss(self, index: int, micro_loss: torch.Tensor) -> None:
        """Before micro-batch ``index``'s backward: every rank's summed loss, in its own slot of one all-reduce.

        Raises:
            NonFiniteError: on every rank, when some rank's loss is not finite.
        """
        slots = torch.zeros(self.ctx.world_size, device=micro_loss.device)
        slots[self.ctx.rank] = micro_loss.detach().float()
        values = all_reduce_sum(slots, self.ctx).tolist()
        bad = [rank for rank, value in enumerate(values) if not math.isfinite(value)]
        if bad:
            raise NonFiniteError("loss", values[bad[0]], micro_batch=index, micro_batches=self.micro_batches,
                                 ranks=bad)

    def check_grad_norm(self, norm: torch.Tensor | float, *, stepped: bool = False) -> None:
        """After clipping measured the (global) gradient norm, before the optimizer steps; or, with ``stepped``,
        after the hooks of the optimizer in backward did.

        Raises:
            NonFiniteError: the norm is not finite.
        """
        value = float(norm)
        if not math.isfinite(value):
            raise NonFiniteError("gradient norm", value, micro_batch=None, micro_batches=self.micro_batches,
                                 ranks=range(self.ctx.world_size), stepped=stepped)
