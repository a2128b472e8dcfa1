"""Sequence log-probabilities, from the whole logits or without them: the chunked loss's approach
(``memory/chunked_loss.py``) for a loss that is not a sum over tokens (DPO, ``training/dpo.py``).

``loss_chunks`` chooses, as for the token loss: the whole logits for one chunk, else ``ChunkedSequenceLogProbs``
as the model's output head. The head gathers the target positions first (in a number the host counted when it
built the batch), then projects and scores them a chunk at a time, adding each target's log-probability into its
row's sum. Only a chunk's float32 logits ``[c, vocab]`` are ever alive.

What differs from the token loss: there, the loss is linear in each token's cross-entropy, so every chunk's
gradients can be computed in forward and the logits dropped. Here the loss is a function of whole rows' sums (a
pair's chosen and rejected sums go through a log-sigmoid), so a chunk's gradient needs a number known only once
every row is summed: each chunk is projected again in backward, with the row's incoming gradient. That costs one
more output-layer matrix multiply per chunk (4 instead of 3) and keeps the targets' hidden states ``[n, dim]`` for
backward; never the logits. A model with soft-capped logits (Gemma 2) passes ``softcap=C``: each chunk's logits
are capped, ``C * tanh(logits / C)``, and their gradient carries the cap's derivative.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from torchtune_ac.training.objective import IGNORE_INDEX


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_ids: Optional[torch.Tensor] = None,
                   n_sequences: Optional[int] = None) -> torch.Tensor:
    """Each row's (or each packed sequence's) summed log-probability of its labels, from the whole logits, in
    float32.

    Args:
        logits: ``[b, s, vocab]``.
        labels: ``[b, s]``, shifted (``labels[:, i]`` follows ``tokens[:, i]``); ``IGNORE_INDEX`` counts for nothing.
        sequence_ids: ``[b, s]``, the sequence each position's label is summed into (a packed batch's); None: its
            row.
        n_sequences: how many sequences ``sequence_ids`` numbers (with it).

    Returns:
        ``[b]`` float32, or ``[n_sequences]``.
    """
    per_token = -F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                 reduction="none")  # [b * s], 0 where ignored
    if sequence_ids is None:
        return per_token.view(labels.shape).sum(dim=1)
    return per_token.new_zeros(n_sequences).index_add_(0, sequence_ids.flatten(), per_token)


def _soft_cap(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """``C * tanh(logits / C)`` in place of float32 ``logits``; ``logits`` as they are without a cap."""
    return logits if softcap is None else logits.div_(softcap).tanh_().mul_(softcap)


class _ChunkedSequenceLogProbs(torch.autograd.Function):
    """``out[r] = sum over targets i of row r of log_softmax(hidden[i] @ weight.T)[targets[i]]`` in float32, chunk
    by chunk; backward projects each chunk again (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor,
                n_rows: int, n_chunks: int, softcap: Optional[float], temperature: float = 1.0,
                entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
        # hidden: [n, dim]; weight: [vocab, dim]; targets, rows: [n]; entropy: [n], filled when given (no gradient)
        out = torch.zeros(n_rows, dtype=torch.float32, device=hidden.device)
        log_norms = []
        start = 0
        for h, y, r in zip(hidden.tensor_split(n_chunks), targets.tensor_split(n_chunks), rows.tensor_split(n_chunks)):
            if not len(y):
                log_norms.append(torch.empty(0, dtype=torch.float32, device=hidden.device))
                continue
            logits = _soft_cap(F.linear(h, weight).float(), softcap)  # [c, vocab]
            if temperature != 1.0:
                logits.div_(temperature)
            log_norm = torch.logsumexp(logits, dim=-1)  # [c]
            out.index_add_(0, r, logits.gather(1, y[:, None]).squeeze(1) - log_norm)
            if entropy is not None:  # H = logsumexp - sum(p * logits)
                entropy[start:start + len(y)] = log_norm - (logits - log_norm[:, None]).exp_().mul_(logits).sum(-1)
            log_norms.append(log_norm)
            start += len(y)
            del logits
        ctx.n_chunks, ctx.softcap, ctx.temperature = n_chunks, softcap, temperature
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            ctx.save_for_backward(hidden, weight, targets, rows, torch.cat(log_norms))
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        hidden, weight, targets, rows, log_norm = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        scale = grad_out.float().index_select(0, rows)  # [n]: each target's row's incoming gradient
        start = 0
        for h, y, g, z in zip(hidden.tensor_split(ctx.n_chunks), targets.tensor_split(ctx.n_chunks),
                              scale.tensor_split(ctx.n_chunks), log_norm.tensor_split(ctx.n_chunks)):
            if not len(y):
                continue
            # d log p(y) / d logits = onehot(y) - softmax; times the row's gradient (and the cap's derivative).
            logits = F.linear(h, weight).float()  # [c, vocab]
            unit = None if ctx.softcap is None else logits.div_(ctx.softcap).tanh_()
            capped = logits if unit is None else unit * ctx.softcap
            if ctx.temperature != 1.0:  # the log-softmax of logits / T: its gradient carries 1 / T
                capped = capped.div_(ctx.temperature)
            grad_logits = capped.sub_(z[:, None]).exp_().neg_()  # -softmax
            grad_logits[torch.arange(len(y), device=y.device), y] += 1.0
            grad_logits = grad_logits.mul_(g[:, None] if ctx.temperature == 1.0 else g[:, None] / ctx.temperature)
            if unit is not None:
                grad_logits.mul_(unit.square_().neg_().add_(1.0))  # d(C tanh(x / C)) / dx = 1 - tanh^2
            grad_logits = grad_logits.to(weight.dtype)
            del logits, unit
            if need_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:start + len(y)])
            if need_weight:
                grad_weight.addmm_(grad_logits.t(), h)
            del grad_logits
            start += len(y)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


@dataclass(frozen=True)
class ChunkedSequenceLogProbs:
    """An output head for the model: each row's summed log-probability of its ``labels``, projected chunk by chunk.

    ``model(tokens, head=ChunkedSequenceLogProbs(labels, n_chunks))`` calls it with the final norm's output and the
    output projection's weight inside the model's forward (so FSDP2 gathers that weight once, and again for
    backward, as for any layer).

    Attributes:
        labels: ``[b, s]`` targets, ``IGNORE_INDEX`` where there is none.
        n_chunks: how many pieces the target positions are split into.
        n_targets: how many labels are not ``IGNORE_INDEX``, counted on the host (the batch's ``target_count``), so
            nothing waits for the device; None: counted here (a host synchronisation on a GPU).
        sequence_ids: ``[b, s]``, the sequence each label is summed into (a packed batch's, ``sequence_logps``);
            None: its row.
        n_sequences: how many sequences ``sequence_ids`` numbers (with it).
    """

    labels: torch.Tensor
    n_chunks: int
    n_targets: Optional[int] = None
    sequence_ids: Optional[torch.Tensor] = None
    n_sequences: Optional[int] = None

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
        """``[b]`` (or ``[n_sequences]``) float32 summed log-probabilities.

        Args:
            hidden: ``[b, s, dim]``, the final norm's output.
            weight: ``[vocab, dim]``, the output projection.
            softcap: C, where the model soft-caps its logits (``C * tanh(logits / C)``).
        """
        n_rows, seq_len = self.labels.shape
        labels = self.labels.flatten()  # [b * s]
        ignored = labels == IGNORE_INDEX
        n_targets = self.n_targets if self.n_targets is not None else int(ignored.numel() - ignored.sum())
        # The target positions in order (a stable sort of a 0/1 key), as the chunked token loss gathers them.
        order = torch.argsort(ignored.to(torch.uint8), stable=True)[:n_targets]  # [n]
        targets = labels.index_select(0, order)  # [n]
        if self.sequence_ids is None:
            rows = torch.div(order, seq_len, rounding_mode="floor")  # [n]
        else:
            rows, n_rows = self.sequence_ids.flatten().index_select(0, order), self.n_sequences
        hidden = hidden.flatten(0, 1).index_select(0, order)  # [n, dim]
        return _ChunkedSequenceLogProbs.apply(hidden, weight, targets, rows, n_rows, self.n_chunks, softcap)


@dataclass(frozen=True)
class ChunkedTokenLogProbs:
    """An output head for the model: each label's own log-probability (not summed), ``[b, s]`` float32 with 0 where
    the label is ``IGNORE_INDEX``, from the logits divided by ``temperature``, projected chunk by chunk as
    ``ChunkedSequenceLogProbs`` does (every target its own "row"). GRPO's per-token ratios need them.

    Attributes:
        labels: ``[b, s]`` targets, ``IGNORE_INDEX`` where there is none.
        n_chunks: how many pieces the target positions are split into.
        temperature: the sampling temperature the log-probabilities are taken at (TRL's ``temperature``).
        n_targets: the labels that are not ``IGNORE_INDEX``, counted on the host; None: counted here.
        entropy: a ``[b, s]`` float32 buffer filled with each target position's entropy (detached), or None.
    """

    labels: torch.Tensor
    n_chunks: int
    temperature: float = 1.0
    n_targets: Optional[int] = None
    entropy: Optional[torch.Tensor] = None

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
        labels = self.labels.flatten()  # [b * s]
        kept = labels != IGNORE_INDEX
        n_targets = self.n_targets if self.n_targets is not None else int(kept.sum())
        order = torch.argsort((~kept).to(torch.uint8), stable=True)[:n_targets]  # [n], row-major order
        targets = labels.index_select(0, order)
        rows = torch.arange(n_targets, device=labels.device)
        flat_entropy = None if self.entropy is None else hidden.new_zeros(n_targets, dtype=torch.float32)
        per_target = _ChunkedSequenceLogProbs.apply(hidden.flatten(0, 1).index_select(0, order), weight, targets,
                                                    rows, n_targets, self.n_chunks, softcap, self.temperature,
                                                    flat_entropy)  # [n]
        if flat_entropy is not None:
            self.entropy.view(-1).index_copy_(0, order, flat_entropy)
        return per_target.new_zeros(labels.shape).index_add(0, order, per_target).view(self.labels.shape)
