"""Batched decoding with a static KV cache: prompts left-padded into one batch, one forward over them, then one
token per step for every row, until each row has emitted an end-of-sequence token or ``max_new_tokens``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.generation.kv_cache import DecodeState, KVCache
from torchtune_ac.models.llama import Attention


@dataclass(frozen=True)
class SamplingConfig:
    """How each next token is drawn: greedy at ``temperature`` 0, else from the softmax of the logits divided by it,
    kept to the ``top_k`` likeliest (0: all) and the smallest set whose probability reaches ``top_p``."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class Completions:
    """Per prompt: the new tokens (the end-of-sequence token included where one came), and whether the row stopped
    at ``max_new_tokens`` without one."""

    tokens: list[list[int]]
    truncated: list[bool]


def sample_next(logits: torch.Tensor, config: SamplingConfig, generator: Optional[torch.Generator]) -> torch.Tensor:
    """``[b]`` next tokens from ``[b, vocab]`` logits."""
    if config.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / config.temperature
    if config.top_k:
        kth = torch.topk(logits, min(config.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens likelier than it already reach top_p (the likeliest is always kept).
        drop = (probs.cumsum(dim=-1) - probs) >= config.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@contextlib.contextmanager
def kv_caches(model: nn.Module, state: DecodeState) -> Iterator[None]:
    """Each attention layer of ``model`` holds a ``KVCache`` over ``state`` inside the block; none after."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    unsupported = [m for m in layers if m.window is not None or m.softcap is not None]
    if not layers or unsupported:
        raise UserError("generation: the KV cache covers full causal attention without soft-capped scores; this "
                        "model has sliding-window or soft-capped attention layers (or none it knows)")
    dtype = next(model.parameters()).dtype
    try:
        for m in layers:
            m.kv_cache = KVCache(state, m.k_proj.out_features // m.head_dim, m.head_dim, dtype)
        yield
    finally:
        for m in layers:
            m.kv_cache = None


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], config: SamplingConfig, *,
             eos_ids: Sequence[int], pad_id: int, generator: Optional[torch.Generator] = None) -> Completions:
    """Complete every prompt (see the module docstring).

    Args:
        model: a ``Llama``-style decoder (``forward(tokens, positions=...)``).
        prompts: token ids, of any lengths.
        config: sampling and length.
        eos_ids: the tokens that end a completion.
        pad_id: what fills a finished row (never read as input to a live row).
        generator: the sampler's random numbers (seeded by the caller: the run's step and rank).
    """
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + config.max_new_tokens
    tokens = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(b, total, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, width - len(prompt):] = True
    valid[:, width:] = True
    positions = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)  # [b, total]: a prompt's first token at 0
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    state = DecodeState(valid)
    out = torch.full((b, config.max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    steps = 0
    with kv_caches(model, state):
        logits = model(tokens, positions=positions[:, :width])[:, -1]  # [b, vocab]
        state.offset = width
        for step in range(config.max_new_tokens):
            next_tokens = torch.where(done, pad_id, sample_next(logits, config, generator))
            out[:, step] = next_tokens
            steps = step + 1
            done |= torch.isin(next_tokens, eos)
            if bool(done.all()) or step + 1 == config.max_new_tokens:
                break
            logits = model(next_tokens[:, None], positions=positions[:, width + step:width + step + 1])[:, -1]
            state.offset += 1
    rows, truncated = [], []
    for row in out[:, :steps].tolist():
        ends = [i for i, t in enumerate(row) if t in set(eos_ids)]
        rows.append(row[:ends[0] + 1] if ends else row)
        truncated.append(not ends)
    return Completions(rows, truncated)
