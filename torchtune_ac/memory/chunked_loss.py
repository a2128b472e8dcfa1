"""The chunked loss, a memory feature (``FEATURE``): the token cross-entropy without the whole logits.

    loss_chunks: null | N              # N > 1: project and score the targets N chunks at a time

``loss_chunks: null`` (the default) chooses from the vocabulary: ``DEFAULT_LOSS_CHUNKS`` chunks when it has at
least ``CHUNKED_LOSS_MIN_VOCAB`` tokens (the logits then outweigh everything else a step keeps), else 1: the targets'
logits at once (see docs/memory.md, "Fitting a bigger model", for the measurements behind this). Either way only
the labelled positions are projected, and a model whose forward asks the head for them (``models.llama.TargetHead``:
Qwen2.5-VL) computes its last block at those positions only.

The whole-logits objective (``training/objective.py``) projects every position to the vocabulary
(``[b, s, vocab]``). ``ChunkedCrossEntropy``, passed to the model as its output head, gives the same sum:
positions whose label is ``IGNORE_INDEX`` are dropped first (the targets are gathered by a sort, in a number the
host counted when it built the batch: no boolean mask, whose size only the device knows), and the rest is
projected and scored a chunk at a time. Each chunk's
  float32 logits live only while that chunk is processed: its gradients with respect to the hidden states and
  to the output weight are computed right away (the weight's accumulated in place), so backward keeps only
  the targets' hidden-state gradients and the weight's gradient, and has nothing to recompute.

A model whose logits are soft-capped (Gemma 2's ``final_logit_softcapping`` C: ``C * tanh(logits / C)``) calls the
head with ``softcap=C``: each chunk's float32 logits are capped before they are scored, and their gradient carries
the cap's derivative ``1 - tanh^2``, which holds a second chunk-sized float32 buffer while a chunk is processed.

Under tensor parallelism the output weight reaches the head split along the vocabulary (a DTensor of this rank's
rows, ``parallel/tensor_parallel.py``), and the loss is computed on the vocabulary shards (loss parallel,
``_VocabParallelChunkedCrossEntropy``): each rank projects its rows only, so a chunk's float32 logits are
``[c, vocab / degree]``; per chunk, the softmax's row maxima are reduced over the group (one all-reduce of ``[c]``),
then its normaliser and the target logit, which one rank holds (one all-reduce of ``[2, c]``). The weight's
gradient is this rank's rows, exact; the hidden states' gradient is a partial sum over the vocabulary shards, which
the gather that fed the head reduces and scatters back along the sequence in backward. The logits are never
gathered: gathering them (or the weight) would put the whole vocabulary on every rank.

Why not recompute each chunk in backward under activation checkpointing: that spends a third more matrix
multiplies on the output layer (the largest one in CPU-sized models), and autograd sums the chunks' weight
gradients by holding a second weight-sized gradient while each chunk's is added. Computing the gradients chunk
by chunk in the forward pass gives the same values with neither cost.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtune_ac.errors import UserError
from torchtune_ac.memory.feature import Alternative, Feature, ResolveInputs
from torchtune_ac.training.objective import (
    IGNORE_INDEX,
    count_target_tokens,
    cross_entropy_sum,
    host_target_count,
    run_model,
)

# loss_chunks: null gives this many chunks for a vocabulary of at least CHUNKED_LOSS_MIN_VOCAB tokens, else 1.
DEFAULT_LOSS_CHUNKS = 8
CHUNKED_LOSS_MIN_VOCAB = 32_000


def _soft_cap_(logits: torch.Tensor, softcap: Optional[float]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Float32 logits ``[c, vocab]`` soft-capped: ``(C * tanh(logits / C), tanh(logits / C))``, the second in place
    of ``logits`` (kept for the cap's derivative); ``(logits, None)`` without a cap."""
    if softcap is None:
        return logits, None
    unit = logits.div_(softcap).tanh_()
    return unit * softcap, unit


def _through_soft_cap_(grad_logits: torch.Tensor, unit: Optional[torch.Tensor]) -> torch.Tensor:
    """The gradient with respect to the uncapped logits: ``grad * (1 - tanh^2)`` (``unit`` is consumed)."""
    return grad_logits if unit is None else grad_logits.mul_(unit.square_().neg_().add_(1.0))


def _scaled_saved_gradients(ctx: Any, grad_total: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
    """The backward of the chunked losses: the hidden states' and weight's gradients computed in forward, times the
    loss's incoming gradient. They are used once: scaled in place rather than holding a second copy."""
    grad_hidden, grad_weight = ctx.saved_tensors
    if grad_hidden is not None:
        grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
    if grad_weight is not None:
        grad_weight.mul_(grad_total.to(grad_weight.dtype))
    return grad_hidden, grad_weight


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, with_gradient: bool,
                softcap: Optional[float] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One chunk of targets: the summed float32 cross-entropy of ``h @ weight.T`` against ``y`` and, with
    ``with_gradient``, its gradient with respect to the logits (the softmax less the targets' one-hot), in
    ``weight``'s dtype, ready for the two matrix multiplies of the backward; with ``softcap`` C, of the capped
    logits ``C * tanh(logits / C)``, the gradient taken through the cap. Eager, the float32 logits are
    overwritten in place; compiled (``_compiled_chunk_loss``), the elementwise work is fused into a reduction and
    one pass that writes the gradient, and no float32 ``[c, vocab]`` tensor is made."""
    logits, unit = _soft_cap_(F.linear(h, weight).float(), softcap)  # [c, vocab]
    log_norm = torch.logsumexp(logits, dim=-1)  # [c]
    loss = (log_norm - logits.gather(1, y[:, None]).squeeze(1)).sum()
    if not with_gradient:
        return loss, None
    grad_logits = logits.sub_(log_norm[:, None]).exp_()  # softmax, in place of the logits
    grad_logits[torch.arange(len(y), device=y.device), y] -= 1.0
    return loss, _through_soft_cap_(grad_logits, unit).to(weight.dtype)


@functools.cache
def _compiled_chunk_loss() -> Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """``_chunk_loss`` under ``torch.compile`` (made on first use: importing Dynamo takes a while)."""
    return torch.compile(_chunk_loss, fullgraph=True)


def _run_chunk_loss(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, with_gradient: bool,
                    softcap: Optional[float], compiled: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    if not compiled:
        return _chunk_loss(h, weight, y, with_gradient, softcap)
    # The chunks' length changes from step to step (with the batch's target count) and between a step's chunks:
    # traced with a symbolic length once, rather than compiled again for each new length.
    torch._dynamo.maybe_mark_dynamic(h, 0)
    torch._dynamo.maybe_mark_dynamic(y, 0)
    return _compiled_chunk_loss()(h, weight, y, with_gradient, softcap)


def _weight_gradient_sum(weight: torch.Tensor) -> torch.Tensor:
    """Where the chunks' weight gradients are summed: float32 whatever the weight's dtype. A bf16 sum rounds the
    running total at every chunk (8 bits of mantissa); in float32 only each chunk's product and the total are
    rounded to bf16 (``_add_chunk_weight_gradient``, ``_weight_gradient_of``)."""
    return torch.zeros_like(weight, dtype=torch.float32)


def _add_chunk_weight_gradient(total: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
    # [vocab, dim] += [c, vocab]^T @ [c, dim]
    if grad_logits.dtype == total.dtype:
        total.addmm_(grad_logits.t(), h)
        return
    # A bf16 product (the matmul adds in float32 within it), rounded once, added in float32; made a block of the
    # vocabulary's rows at a time, each no larger than the chunk's logits, never a second weight-sized tensor.
    rows = max(1, len(h) * len(total) // total.shape[1])
    for start in range(0, len(total), rows):
        total[start:start + rows].add_(torch.mm(grad_logits[:, start:start + rows].t(), h))


def _weight_gradient_of(total: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return total.to(weight.dtype)  # the same tensor for a float32 weight


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_i CE(hidden[i] @ weight.T, targets[i])`` in float32, chunk by chunk, with its gradients computed in
    forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_chunks: int,
                softcap: Optional[float], compiled: bool) -> torch.Tensor:
        # hidden: [n, dim]; weight: [vocab, dim]; targets: [n]
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        weight_sum = _weight_gradient_sum(weight) if need_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        start = 0
        for h, y in zip(hidden.tensor_split(n_chunks), targets.tensor_split(n_chunks)):
            if not len(y):
                continue
            loss, grad_logits = _run_chunk_loss(h, weight, y, need_hidden or need_weight, softcap, compiled)
            total += loss
            if grad_logits is not None:
                if need_hidden:
                    torch.mm(grad_logits, weight, out=grad_hidden[start:start + len(y)])
                if need_weight:
                    _add_chunk_weight_gradient(weight_sum, grad_logits, h)
                del grad_logits
            start += len(y)
        grad_weight = _weight_gradient_of(weight_sum, weight) if need_weight else None
        del weight_sum
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        return (*_scaled_saved_gradients(ctx, grad_total), None, None, None, None)


class _VocabParallelChunkedCrossEntropy(torch.autograd.Function):
    """``_ChunkedLinearCrossEntropy`` on a vocabulary shard: ``weight`` holds the vocabulary's rows
    ``[offset, offset + len(weight))``, ``hidden`` and ``targets`` are whole and the same on every rank of
    ``group``. Returns the whole sum on every rank; the hidden states' gradient is this shard's part of it."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, n_chunks: int, offset: int,
                group: dist.ProcessGroup, softcap: Optional[float]) -> torch.Tensor:
        # hidden: [n, dim]; weight: [vocab / degree, dim]; targets: [n], ids of the whole vocabulary
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        weight_sum = _weight_gradient_sum(weight) if need_weight else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows = len(weight)
        start = 0
        for h, y in zip(hidden.tensor_split(n_chunks), targets.tensor_split(n_chunks)):
            if not len(y):
                continue
            logits, unit = _soft_cap_(F.linear(h, weight).float(), softcap)  # [c, vocab / degree]
            row_max = logits.max(dim=-1).values  # [c]
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            logits.sub_(row_max[:, None])
            local = y - offset
            here = (local >= 0) & (local < rows)  # [c]: the targets in this rank's rows
            local = local.clamp(0, rows - 1)
            # [2, c]: sum of exp over this shard; the target's (max-shifted) logit where this rank holds it, else 0.
            sums = torch.stack([logits.exp().sum(dim=-1), logits.gather(1, local[:, None]).squeeze(1) * here])
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
            log_norm = sums[0].log()  # [c], of the max-shifted logits
            total += (log_norm - sums[1]).sum()
            if need_hidden or need_weight:
                grad_logits = logits.sub_(log_norm[:, None]).exp_()  # this shard of the softmax
                grad_logits[torch.arange(len(y), device=y.device), local] -= here.to(grad_logits.dtype)
                grad_logits = _through_soft_cap_(grad_logits, unit).to(weight.dtype)
                if need_hidden:
                    torch.mm(grad_logits, weight, out=grad_hidden[start:start + len(y)])
                if need_weight:
                    _add_chunk_weight_gradient(weight_sum, grad_logits, h)
                del grad_logits
            del logits
            start += len(y)
        grad_weight = _weight_gradient_of(weight_sum, weight) if need_weight else None
        del weight_sum
        ctx.save_for_backward(grad_hidden, grad_weight)
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        return (*_scaled_saved_gradients(ctx, grad_total), None, None, None, None, None)


def _vocab_parallel_loss(hidden: DTensor, weight: DTensor, targets: torch.Tensor, order: torch.Tensor,
                         n_chunks: int, softcap: Optional[float]) -> torch.Tensor:
    """The chunked loss of a weight split along the vocabulary over a 1-D mesh (tensor parallelism) and hidden
    states whole on every rank of it (a replicated DTensor)."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or not weight.placements[0].is_shard(0):
        raise ValueError(f"the chunked loss takes an output weight split along the vocabulary over one mesh "
                         f"dimension, got placements {weight.placements} over a {mesh.ndim}-D mesh")
    _, (offset, _) = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    # The hidden states' gradient is a partial sum (each rank's vocabulary rows): say so, and the gather that
    # fed the head reduces it in backward.
    local_hidden = hidden.to_local(grad_placements=(Partial(),)).flatten(0, 1).index_select(0, order)  # [n, dim]
    return _VocabParallelChunkedCrossEntropy.apply(local_hidden, weight.to_local(), targets, n_chunks, offset,
                                                   mesh.get_group(), softcap)


@dataclass(frozen=True)
class ChunkedCrossEntropy:
    """An output head for the model: the summed cross-entropy of ``labels``, projected chunk by chunk.

    ``model(tokens, head=ChunkedCrossEntropy(labels, n_chunks))`` calls it with the final norm's output and the
    output projection's weight, inside the model's forward (so FSDP2 gathers that weight once, not per chunk).
    The gradients are computed in this call (see the module docstring); call ``backward`` on the result once.

    Attributes:
        labels: ``[b, s]`` targets, ``IGNORE_INDEX`` where there is none.
        n_chunks: how many pieces the target positions are split into (fewer when there are fewer targets).
        n_targets: how many labels are not ``IGNORE_INDEX``, counted on the host (the batch's ``target_count``):
            the targets are then gathered with shapes known in advance, so nothing waits for the device. None:
            counted from ``labels`` here, a host synchronisation when they are on a GPU.
        compiled: each chunk's loss and logits' gradient through ``torch.compile`` (the run's ``compile: true``);
            under tensor parallelism the chunks stay eager (their collectives split them).
    """

    labels: torch.Tensor
    n_chunks: int
    n_targets: Optional[int] = None
    compiled: bool = False

    def target_rows(self) -> Optional[torch.Tensor]:
        """The target positions ``[n]``, in order, as indices into the ``b * s`` flattened labels; None when the
        host counted none (``models.llama.TargetHead``: the model may then compute its last block at these rows)."""
        if self.n_targets == 0:
            return None
        labels = self.labels.flatten()  # [b * s]
        ignored = labels == IGNORE_INDEX
        n_targets = self.n_targets if self.n_targets is not None else int(ignored.numel() - ignored.sum())
        # The target positions first, in order (a stable sort of a 0/1 key), then the first n_targets of them: a
        # gather of a size known on the host, where a boolean mask's size would have to be read from the device.
        return torch.argsort(ignored.to(torch.uint8), stable=True)[:n_targets]  # [n]

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
        """The summed float32 cross-entropy (a 0-d tensor).

        Args:
            hidden: ``[b, s, dim]``, the final norm's output (a replicated DTensor under tensor parallelism), or
                ``[n, dim]``, its rows at ``target_rows()`` already.
            weight: ``[vocab, dim]``, the output projection (tied to the embedding or not); under tensor
                parallelism a DTensor split along the vocabulary, and the loss is computed on the shards.
            softcap: C, where the model soft-caps its logits (``C * tanh(logits / C)``).
        """
        order = self.target_rows()
        if order is None:
            order = torch.zeros(0, dtype=torch.long, device=self.labels.device)
        targets = self.labels.flatten().index_select(0, order)  # [n]
        if isinstance(weight, DTensor):
            return _vocab_parallel_loss(hidden, weight, targets, order, self.n_chunks, softcap)
        if hidden.ndim == 3:  # [n, dim]: ignored positions never reach the projection
            hidden = hidden.flatten(0, 1).index_select(0, order)
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, self.n_chunks, softcap, self.compiled)


@dataclass(frozen=True)
class ChunkedCrossEntropyObjective:
    """The step's objective (``training/objective.py``) with the loss computed through ``ChunkedCrossEntropy``
    as the model's output head: the same sums as the whole logits, ``n_chunks`` chunks of targets at a time;
    ``compiled``: each chunk's elementwise work compiled (see ``ChunkedCrossEntropy``)."""

    n_chunks: int
    compiled: bool = False
    metric_names = ()
    loss_name = "ce_loss"
    loss_scale = None

    def targets(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return count_target_tokens(batch["labels"])

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if self.n_chunks == 1 and not runs_target_head(model):
            # A forward or an output projection that takes no head (an adapter on it, ``adapter.output``): the
            # whole logits.
            return cross_entropy_sum(run_model(model, batch), batch["labels"])
        head = ChunkedCrossEntropy(batch["labels"], self.n_chunks, host_target_count(batch), self.compiled)
        return run_model(model, batch, head=head)


def loss_objective(n_chunks: int, compiled: bool = False) -> ChunkedCrossEntropyObjective:
    """The objective of a ``loss_chunks`` setting: the loss through ``ChunkedCrossEntropy``, at the targets only, in
    ``n_chunks`` chunks (1: all at once), compiled when the run compiles (``compiled``) and there are chunks."""
    return ChunkedCrossEntropyObjective(n_chunks, compiled and n_chunks > 1)


# ----------------------------------------------------------------------------------------------------- the feature


def takes_output_head(model: nn.Module) -> bool:
    """Whether the model's forward accepts ``head=`` (the chunked loss runs through it)."""
    return "head" in inspect.signature(model.forward).parameters


def runs_target_head(model: nn.Module) -> bool:
    """Whether a loss head reaches ``model``'s output projection: its forward takes ``head=`` and its output
    projection passes it on (``OutputProjection.takes_head``; an adapter on it, ``adapter.output``, does not)."""
    output = getattr(model, "output", None)
    return takes_output_head(model) and bool(getattr(output, "takes_head", False))


def _resolve(inputs: ResolveInputs) -> int:
    chunks = inputs.memory.loss_chunks
    if chunks is None:
        large = inputs.vocab_size is not None and inputs.vocab_size >= CHUNKED_LOSS_MIN_VOCAB
        chunks = DEFAULT_LOSS_CHUNKS if large else 1
    if chunks > 1 and not takes_output_head(inputs.model):
        raise UserError(
            f"loss_chunks={chunks}: the chunked loss runs through the model's output head, and "
            f"{type(inputs.model).__name__}.forward takes no `head` argument; set loss_chunks: 1"
        )
    return chunks


def _describe(setting: int, vocab_size: Optional[int]) -> str:
    vocab = f" (vocabulary {vocab_size:,})" if vocab_size else ""
    if setting > 1:
        return (f"{setting} chunks{vocab}: targets only, each chunk's gradients computed as it goes (nothing "
                "recomputed in backward), never the whole logits")
    return f"targets only{vocab}, at once: never the logits of unlabelled positions"


def _alternatives(setting: int) -> list[Alternative]:
    return [Alternative(f"loss_chunks={DEFAULT_LOSS_CHUNKS}", DEFAULT_LOSS_CHUNKS)] if setting == 1 else []


FEATURE = Feature(name="loss_chunks", label="loss", off=1, resolve=_resolve, describe=_describe,
                  alternatives=_alternatives)
