"""The dense reference for packed attention, kept here as the tests' oracle (production computes attention per
document, see ``torchtune_ac.models.attention``).

The oracle is the attention the model computed before packed attention went per document, written out:
a ``[b, 1, s, s]`` mask that is causal and stays within each document, K/V copied to one per query head, every
query-key pair of the row scored, and the masked ones dropped. With dropout it multiplies the probabilities
by given masks, so that it can be run with the very masks the per-document path drew (``DropoutMaskRecorder``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_ac.models import llama
from torchtune_ac.models.attention import document_starts


def document_causal_mask(document_ids: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """Boolean attention mask ``[b, 1, s, s]``: causal, only within the same document, and with a ``window`` W
    only the W - 1 tokens before each query besides itself.

    Documents are contiguous runs of equal ids: a run whose id repeats an earlier, non-adjacent run's id is
    still a document of its own.
    """
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    if window is not None:
        causal = causal.triu(-(window - 1))
    runs = document_starts(document_ids).cumsum(dim=1)  # [b, s]: index of each token's document
    same_doc = runs.unsqueeze(2) == runs.unsqueeze(1)  # [b, s, s]
    return (same_doc & causal).unsqueeze(1)


def document_spans(document_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document, row after row (the order the per-document path visits them)."""
    spans = []
    for row, starts in enumerate(document_starts(document_ids).tolist()):
        begins = [i for i, start in enumerate(starts) if start] + [len(starts)]
        spans.extend((row, a, b) for a, b in zip(begins[:-1], begins[1:]))
    return spans


def dense_dropout_mask(
    document_ids: torch.Tensor, n_heads: int, masks: list[torch.Tensor], p: float
) -> torch.Tensor:
    """Assemble per-document keep-masks ``[1, n_heads, L, L]`` (in ``document_spans`` order) into one dense
    ``[b, n_heads, s, s]`` multiplier (kept / (1 - p), elsewhere 0)."""
    b, s = document_ids.shape
    spans = document_spans(document_ids)
    assert len(masks) == len(spans), f"{len(masks)} dropout masks for {len(spans)} documents"
    dense = torch.zeros(b, n_heads, s, s)
    for (row, start, end), mask in zip(spans, masks):
        assert mask.shape == (1, n_heads, end - start, end - start), (mask.shape, (row, start, end))
        dense[row, :, start:end, start:end] = mask[0]
    return dense / (1 - p)


def dense_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    *,
    dropout: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Dense masked attention over the whole row: ``q [b, h, s, hd]``, ``k, v [b, h_kv, s, hd]`` ->
    ``[b, s, h, hd]`` (the layout ``causal_attention`` returns). ``dropout``: a ``[b, h, s, s]`` multiplier
    from ``dense_dropout_mask``, or None; ``scale``: the score factor, None for ``1 / sqrt(head_dim)``;
    ``window``: the sliding window, None for none; ``softcap``: C for scores ``C * tanh(score / C)``."""
    repeat = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1)  # [b, h, s, hd]
    v = v.repeat_interleave(repeat, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale  # [b, h, s, s]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~document_causal_mask(document_ids, window), float("-inf"))
    probs = scores.softmax(dim=-1)
    if dropout is not None:
        probs = probs * dropout
    return (probs @ v).transpose(1, 2)


@contextlib.contextmanager
def dense_attention_oracle(
    document_ids: torch.Tensor, dropout_masks: Optional[list[torch.Tensor]] = None, p: float = 0.0
) -> Iterator[None]:
    """Within the block, ``Llama`` computes packed attention with ``dense_document_attention`` (the mask made
    from ``document_ids``, not from the model's document runs, and each layer's window). With ``dropout_masks``
    (every layer's masks, in call order, as recorded from the per-document path), layer after layer takes its
    documents' masks."""
    remaining = list(dropout_masks or [])
    n_documents = len(document_spans(document_ids))

    def oracle(q, k, v, *, dropout_p, runs, scale=None, window=None, softcap=None, sinks=None):
        assert runs is not None, "the oracle stands in for packed attention only"
        assert sinks is None, "the oracle has no attention sinks"
        dropout = None
        if dropout_p > 0.0:
            assert len(remaining) >= n_documents, "no recorded dropout masks left for this layer"
            layer_masks = [remaining.pop(0) for _ in range(n_documents)]
            dropout = dense_dropout_mask(document_ids, q.shape[1], layer_masks, p)
        return dense_document_attention(q, k, v, document_ids, dropout=dropout, scale=scale, window=window,
                                        softcap=softcap)

    original = llama.causal_attention
    llama.causal_attention = oracle
    try:
        yield
    finally:
        llama.causal_attention = original
    assert not remaining, f"{len(remaining)} recorded dropout masks were not used"


class DropoutMaskRecorder(TorchDispatchMode):
    """Records the keep-masks of every dropout drawn while active (``aten.bernoulli_``: 1 keep, 0 drop).

    Use it on a model whose only dropout is attention dropout, for one forward without activation
    checkpointing (a recompute would draw the masks a second time)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.bernoulli_.float:
            self.masks.append(out.detach().clone())
        return out
