"""A static KV cache: each attention layer's keys and values for a batch's prompt and completion, written in place
as decoding advances, read with a mask of the keys each query may see (not padding, not later positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DecodeState:
    """What every layer's cache shares: where the next tokens are written, and which positions hold a token.

    Attributes:
        valid: ``[b, total]`` bool, False on the prompts' left padding.
        offset: the first position the next forward writes.
    """

    valid: torch.Tensor
    offset: int = 0


class KVCache:
    """One attention layer's keys and values ``[b, n_kv, total, hd]``, allocated once for the whole generation."""

    def __init__(self, state: DecodeState, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        b, total = state.valid.shape
        self.state = state
        self.k = torch.zeros(b, n_kv_heads, total, head_dim, dtype=dtype, device=state.valid.device)
        self.v = torch.zeros_like(self.k)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale) -> torch.Tensor:
        """Write ``k``, ``v`` ``[b, n_kv, s, hd]`` at the state's offset and attend ``q`` ``[b, n_heads, s, hd]`` to
        every key so far; returns ``[b, s, n_heads, hd]``."""
        start, s = self.state.offset, q.shape[2]
        end = start + s
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        key = torch.arange(end, device=q.device)
        query = torch.arange(start, end, device=q.device)
        causal = key[None, :] <= query[:, None]  # [s, end]
        # A query always sees itself, so a padding query's row is never empty (its output is never used).
        mask = (causal & self.state.valid[:, None, :end]) | (key[None, :] == query[:, None])  # [b, s, end]
        out = F.scaled_dot_product_attention(q, self.k[:, :, :end], self.v[:, :, :end], attn_mask=mask[:, None],
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)
