"""A static KV cache: each attention layer's keys and values for a batch's prompt and completion, allocated once for
the whole generation, written in place at the slots the forward covers and read whole with a mask of the keys each
query may see (not padding, not later slots, within the layer's sliding window). Every decode step has the same
shapes, so a compiled step never recompiles and nothing is read back to the host.

Scores that no SDPA kernel takes (Gemma 2's soft cap, gpt-oss's attention sinks) are computed explicitly, as
``models/attention.py``'s ``_explicit_attention`` computes them over a whole sequence."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn


class DecodeState:
    """What every layer's cache shares: which slots hold a token, the slots the next forward writes, and the masks
    of the keys its queries see, one per sliding window in the model (None: full causal attention), as booleans and,
    given ``dtype``, as the additive masks (0 seen, -inf not) SDPA would otherwise convert the booleans to in every
    layer of every step.

    Args:
        valid: ``[b, total]`` bool, False on the prompts' left padding.
        windows: the attention windows of the model's layers.
        dtype: the queries' dtype (the model's), for the additive masks; None: none are kept.
        filled_from: a slot from which on every row's slots hold a token (the completions'); None: ``valid`` is read.
    """

    def __init__(self, valid: torch.Tensor, windows: Iterable[Optional[int]],
                 dtype: Optional[torch.dtype] = None, filled_from: Optional[int] = None) -> None:
        self.valid = valid
        self.filled_from = valid.shape[1] if filled_from is None else filled_from
        self.windows = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
        self.dtype = dtype
        self.index: Optional[torch.Tensor] = None
        self.slot: Optional[int] = None  # the one slot ``index`` holds, where ``point_at`` set it
        self.masks: dict[Optional[int], torch.Tensor] = {}
        self.biases: dict[Optional[int], torch.Tensor] = {}
        self.valid_bias = None if dtype is None else _additive(valid, dtype)  # [b, total]

    def point(self, index: torch.Tensor) -> None:
        """The next forward writes slots ``index`` ``[s]`` (on the device). With the same ``s`` as the last call the
        tensors are updated in place, so a compiled step sees the same inputs every time."""
        key = torch.arange(self.valid.shape[1], device=index.device)
        behind = index[:, None] - key[None, :]  # [s, total]: query slot - key slot
        same_shape = self.index is not None and self.index.shape == index.shape
        for window in self.windows:
            allowed = behind >= 0 if window is None else (behind >= 0) & (behind < window)
            # A query always sees itself, so a padding query's row is never empty (its output is never used).
            mask = ((allowed[None] & self.valid[:, None, :]) | (behind == 0)[None])[:, None]  # [b, 1, s, total]
            if same_shape:
                self.masks[window].copy_(mask)
            else:
                self.masks[window] = mask
            if self.dtype is not None:
                if same_shape:
                    self.biases[window].copy_(_additive(mask, self.dtype))
                else:
                    self.biases[window] = _additive(mask, self.dtype)
        if same_shape:
            self.index.copy_(index)
        else:
            self.index = index.clone()
        self.slot = None

    def point_at(self, slot: int) -> None:
        """The next forward writes the one slot ``slot``. Right after a forward over ``slot - 1`` alone (a decode
        step) the masks change in at most three columns, written in place: the new slot seen, the last one seen only
        where it holds a token (nothing to write from ``filled_from`` on), the one leaving a sliding window not
        seen."""
        if self.slot != slot - 1 or self.index is None or self.index.shape != (1,):
            self.point(torch.tensor([slot], device=self.valid.device))
            self.slot = slot
            return
        self.index.fill_(slot)
        previous = slot - 1
        b, total = self.valid.shape
        for window in self.windows:
            columns = [(self.masks[window].view(b, total), True, False, self.valid)]
            if self.dtype is not None:
                columns.append((self.biases[window].view(b, total), 0.0, float("-inf"), self.valid_bias))
            for mask, seen, unseen, valid in columns:
                mask[:, slot] = seen
                if window == 1:
                    mask[:, previous] = unseen
                elif previous < self.filled_from:
                    mask[:, previous] = valid[:, previous]
                if window is not None and window > 1 and slot >= window:
                    mask[:, slot - window] = unseen
        self.slot = slot


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``mask`` is True, -inf elsewhere, as SDPA turns a boolean mask into the scores' addend."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class KVCache:
    """One attention layer's keys and values ``[b, n_kv, total, hd]``.

    Args:
        state: the generation's shared state.
        attention: the layer (its window, soft cap and sinks are read from it).
        dtype: the cache's dtype (the model's).
    """

    def __init__(self, state: DecodeState, attention: nn.Module, dtype: torch.dtype) -> None:
        b, total = state.valid.shape
        self.state = state
        self.attention = attention
        n_kv = attention.k_proj.out_features // attention.head_dim
        self.k = torch.zeros(b, n_kv, total, attention.head_dim, dtype=dtype, device=state.valid.device)
        self.v = torch.zeros_like(self.k)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float]) -> torch.Tensor:
        """Write ``k``, ``v`` ``[b, n_kv, s, hd]`` at the state's slots and attend ``q`` ``[b, n_heads, s, hd]`` to
        the keys its mask allows; returns ``[b, s, n_heads, hd]``."""
        if torch.compiler.is_compiling() or self.state.slot is None:
            self.k.index_copy_(2, self.state.index, k.to(self.k.dtype))
            self.v.index_copy_(2, self.state.index, v.to(self.v.dtype))
        else:  # eager, one slot known on the host: a plain strided copy (a compiled step never reads the int)
            slot = self.state.slot
            self.k[:, :, slot:slot + 1] = k
            self.v[:, :, slot:slot + 1] = v
        window = self.attention.window
        softcap, sinks = self.attention.softcap, self.attention.sinks
        if softcap is None and sinks is None:
            bias = self.state.biases.get(window)
            mask = bias if bias is not None and bias.dtype == q.dtype else self.state.masks[window]
            if q.shape[2] == 1 and torch.compiler.is_compiling():  # a compiled decode step's one query
                out = _one_query_attention(q, self.k, self.v, mask, scale=scale)
            else:
                out = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, scale=scale,
                                                     enable_gqa=q.shape[1] != self.k.shape[1])
        else:
            out = _explicit_scores_attention(q, self.k, self.v, self.state.masks[window], scale=scale,
                                             softcap=softcap, sinks=sinks)
        return out.transpose(1, 2)


def _one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                         scale: Optional[float]) -> torch.Tensor:
    """A decode step's attention (one query per row), ``[b, n_heads, 1, hd]``, as two batched matmuls around a
    softmax: inside a compiled step the scale, the mask ``[b, 1, 1, total]`` (additive or boolean) and the softmax
    fuse into one kernel, where the CPU's flash SDPA kernel costs several times the arithmetic for one query.
    Grouped K/V are read in place, never copied."""
    b, n_heads, _, hd = q.shape
    n_kv, total = k.shape[1], k.shape[2]
    group = n_heads // n_kv  # query head h reads K/V head h // group
    scores = torch.matmul(q.reshape(b, n_kv, group, hd), k.transpose(-1, -2))  # [b, n_kv, group, total]
    scores = scores * (hd**-0.5 if scale is None else scale)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask.view(b, 1, 1, total), float("-inf"))
    else:
        scores = scores + mask.view(b, 1, 1, total)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # as SDPA's kernels: a float32 softmax
    return torch.matmul(probs, v).view(b, n_heads, 1, hd)  # [b, n_kv, group, hd] -> [b, n_heads, 1, hd]


def _explicit_scores_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                               scale: Optional[float], softcap: Optional[float],
                               sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Scale, cap ``C * tanh(score / C)``, mask ``[b, 1, s, total]``, each head's sink logit joined to its row, a
    float32 softmax, then the values; ``[b, n_heads, s, hd]``. Grouped K/V are read in place, never copied."""
    b, n_heads, s, hd = q.shape
    n_kv, total = k.shape[1], k.shape[2]
    group = n_heads // n_kv  # query head h reads K/V head h // group
    scores = torch.matmul(q.reshape(b, n_kv, group * s, hd), k.transpose(-1, -2))  # [b, n_kv, group * s, total]
    scores = scores.view(b, n_kv, group, s, total) * (hd**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, n_kv, group, 1, 1).expand(b, n_kv, group, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    out = torch.matmul(probs.reshape(b, n_kv, group * s, total), v)  # [b, n_kv, group * s, hd]
    return out.view(b, n_heads, s, hd)
