"""Stop a step whose loss or gradient norm is not finite, before the optimizer takes it in.

A loss that turns NaN or infinite at hour 20 would otherwise be stepped into the weights, and the next
checkpoint would save them. Checked on every rank together, with one all-reduce and one read of the device per
optimizer step (each read drains a GPU's queue of work, so the step reads once, and nothing else waits):

- each micro-batch's loss, written into this rank's slot of a device tensor after its forward, costs nothing
  then (``record_loss``);
- after the last backward, and before ``optimizer.step()`` (``read``): every rank's micro-batch losses (one
  all-reduce of the slots), the step's summed loss, the gradient norm and the token counts come to the host in
  one read. A non-finite loss raises, naming the first micro-batch whose loss it was and the ranks that saw it;
  else a non-finite gradient norm (a gradient overflowed) raises. Either way the optimizer never steps, so the
  weights are untouched. With the optimizer step in backward the parameters are stepped inside the last
  backward, before anything can be read: the run still stops at the end of that step, and the stepped state is
  never saved (``NonFiniteError.stepped``).

A non-finite loss goes through its backward (its gradients are not finite either) and the micro-batches after it
still run: stopping before that backward would take a read of each micro-batch's loss, one synchronisation each.

The recipe turns ``NonFiniteError`` into a stop that saves nothing, so the newest checkpoint stays the last good one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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
        loss_scale: the config key scaling the loss and its gradient, with its value (``Objective.loss_scale``).
    """

    def __init__(self, what: str, value: float, *, micro_batch: Optional[int], micro_batches: int,
                 ranks: Sequence[int], stepped: bool = False, loss_scale: Optional[tuple[str, float]] = None) -> None:
        self.what, self.value, self.micro_batch = what, value, micro_batch
        self.micro_batches, self.ranks, self.stepped = micro_batches, list(ranks), stepped
        self.loss_scale = loss_scale
        super().__init__(self.describe())

    def describe(self) -> str:
        if self.micro_batch is None:
            where = f"every one of the {self.micro_batches} micro-batch loss(es) was finite"
            return f"the gradient norm is {self.value} ({where})"
        ranks = ", ".join(str(r) for r in self.ranks)
        return (f"the loss of micro-batch {self.micro_batch + 1} of {self.micro_batches} is {self.value} "
                f"(rank{'s' if len(self.ranks) > 1 else ''} {ranks})")


@dataclass(frozen=True)
class StepValues:
    """What the one read of a step brought to the host (global values: summed over micro-batches and ranks)."""

    loss_sum: float
    grad_norm: float
    target_tokens: int
    input_tokens: int
    metric_sums: tuple[float, ...] = ()  # the objective's metric sums (``training.objective.LossParts``)
    targets: int = 0  # what the loss is a mean over: the target tokens, or the objective's own count (DPO: pairs)


class FiniteChecks:
    """The checks of one optimizer step (see the module docstring); every rank calls them at the same points.

    Args:
        ctx: rank and world size.
        micro_batches: micro-batches in the step.
        device: where the losses are (the model's device).
        loss_scale: the config key scaling the loss, and its value, for the error (``Objective.loss_scale``).
    """

    def __init__(self, ctx: DistributedContext, micro_batches: int, device: torch.device,
                 loss_scale: Optional[tuple[str, float]] = None) -> None:
        self.ctx = ctx
        self.loss_scale = loss_scale
        self.micro_batches = micro_batches
        self.losses = torch.zeros(micro_batches, ctx.world_size, device=device)  # [micro-batch, rank]

    def record_loss(self, index: int, micro_loss: torch.Tensor) -> None:
        """Keep micro-batch ``index``'s summed loss in this rank's slot (on the device: nothing is read)."""
        self.losses[index, self.ctx.rank].copy_(micro_loss.detach())

    def gather(self, loss_sum: torch.Tensor, norm: torch.Tensor, counts: torch.Tensor,
               metric_sums: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What ``read`` brings to the host, as one float64 tensor on the losses' device: every rank's micro-batch
        losses, the summed loss, the metric sums, the norm and the counts. The norm may be elsewhere (on the CPU
        when FSDP2 keeps the gradients in host memory: ``fsdp.cpu_offload``), and is moved here first."""
        device = self.losses.device
        summed = [self.losses.flatten(), loss_sum.detach().float().view(1).to(device)]
        if metric_sums is not None:
            summed.append(metric_sums.detach().float().flatten().to(device))
        reduced = all_reduce_sum(torch.cat(summed), self.ctx)
        return torch.cat([reduced.double(), norm.detach().double().view(1).to(device), counts.double().to(device)])

    def read(self, loss_sum: torch.Tensor, norm: torch.Tensor, counts: torch.Tensor, *,
             stepped: bool = False, metric_sums: Optional[torch.Tensor] = None) -> StepValues:
        """The step's one host synchronisation: all ranks' losses, ``loss_sum`` (this rank's summed loss, summed
        here over ranks), the global gradient ``norm``, the global ``counts`` (targets, inputs, and target tokens
        when the objective counts other targets than tokens) and
        ``metric_sums`` (this rank's, summed here over ranks), read at once.

        Args:
            stepped: the parameters were already stepped (in backward), so the error says so.

        Raises:
            NonFiniteError: on every rank, when some rank's micro-batch loss is not finite (the first such
                micro-batch is named), else when the gradient norm is not finite.
        """
        values = self.gather(loss_sum, norm, counts, metric_sums).tolist()
        n = self.micro_batches * self.ctx.world_size
        k = counts.numel()
        losses, total, metrics = values[:n], values[n], values[n + 1:-(k + 1)]
        norm_value, targets, inputs, *tokens = values[-(k + 1):]
        for index in range(self.micro_batches):
            row = losses[index * self.ctx.world_size:(index + 1) * self.ctx.world_size]
            bad = [rank for rank, value in enumerate(row) if not math.isfinite(value)]
            if bad:
                raise NonFiniteError("loss", row[bad[0]], micro_batch=index, micro_batches=self.micro_batches,
                                     ranks=bad, stepped=stepped, loss_scale=self.loss_scale)
        if not math.isfinite(norm_value):
            raise NonFiniteError("gradient norm", norm_value, micro_batch=None, micro_batches=self.micro_batches,
                                 ranks=range(self.ctx.world_size), stepped=stepped, loss_scale=self.loss_scale)
        return StepValues(loss_sum=total, grad_norm=norm_value, target_tokens=int(tokens[0] if tokens else targets),
                          input_tokens=int(inputs), metric_sums=tuple(metrics), targets=int(targets))
