"""Batched decoding with a static KV cache: prompts left-padded into one batch, one forward over them, then one
token per step for every row, until each row has emitted an end-of-sequence token or ``max_new_tokens``."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.generation.kv_cache import DecodeState, KVCache
from torchtune_ac.models.llama import Attention, OutputProjection


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
    logits = logits.float()
    if config.temperature != 1.0:  # x / 1 is x: no division
        logits = logits / config.temperature
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
    if not layers:
        raise UserError("generation: the model has no attention layers the KV cache knows (a Llama-style decoder)")
    dtype = next(model.parameters()).dtype
    try:
        for m in layers:
            m.kv_cache = KVCache(state, m, dtype)
        yield
    finally:
        for m in layers:
            m.kv_cache = None


def _last_position_logits(x: torch.Tensor, weight: torch.Tensor, softcap: Optional[float] = None) -> torch.Tensor:
    """The output projection of the last position only (``x`` ``[b, s, dim]``): a prompt batch's forward never
    holds ``[b, s, vocab]`` logits. Computed as ``OutputProjection`` computes them."""
    logits = F.linear(x[:, -1], weight)  # [b, vocab]
    return logits if softcap is None else torch.tanh(logits / softcap) * softcap


def _decode_step(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The last position's logits ``[b, vocab]`` of one forward over the cache."""
    if type(getattr(model, "output", None)) is OutputProjection:
        return model(tokens, positions=positions, head=_last_position_logits)
    return model(tokens, positions=positions)[:, -1]  # an adapted output layer takes no head


_COMPILED_DECODE_STEP = None
# A compiled step's cache holds a multiple of this many slots, so that prompt batches of different widths within one
# multiple give it the same shapes and reuse its compiled code (the extra slots are later slots: never seen).
COMPILED_CACHE_MULTIPLE = 16


def _compiled_decode_step():
    """``_decode_step`` compiled once per process with static shapes (every step of a generation has the same)."""
    global _COMPILED_DECODE_STEP
    if _COMPILED_DECODE_STEP is None:
        _COMPILED_DECODE_STEP = torch.compile(_decode_step, dynamic=False)
    return _COMPILED_DECODE_STEP


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], config: SamplingConfig, *,
             eos_ids: Sequence[int], pad_id: int, generator: Optional[torch.Generator] = None,
             check_every: int = 8, compile_decode: bool = False) -> Completions:
    """Complete every prompt (see the module docstring).

    Args:
        model: a ``Llama``-style decoder (``forward(tokens, positions=...)``); full, sliding-window, soft-capped
            attention and attention sinks.
        prompts: token ids, of any lengths.
        config: sampling and length.
        eos_ids: the tokens that end a completion.
        pad_id: what fills a finished row (never read as input to a live row).
        generator: the sampler's random numbers (seeded by the caller: the run's step and rank).
        check_every: the decode loop reads back whether every row has finished once per this many tokens (each
            read is a host synchronisation on a GPU); rows that finish in between only emit ``pad_id``.
        compile_decode: run the one-token decode step through ``torch.compile`` (static shapes: it compiles once
            per model, batch size and cache length, the prompt width plus ``max_new_tokens`` rounded up to a
            multiple of ``COMPILED_CACHE_MULTIPLE``; never within a generation).

    Returns:
        ``Completions``: the results are the same for every ``check_every`` and with or without ``compile_decode``
        (compiled kernels may round differently, which can change a sampled or tied token).
    """
    if check_every < 1:
        raise ValueError(f"check_every={check_every}: must be at least 1")
    device = next(model.parameters()).device
    b, width = len(prompts), max(len(p) for p in prompts)
    total = width + config.max_new_tokens
    if compile_decode:
        total = -(-total // COMPILED_CACHE_MULTIPLE) * COMPILED_CACHE_MULTIPLE
    tokens = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    valid = torch.zeros(b, total, dtype=torch.bool, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        valid[row, width - len(prompt):] = True
    valid[:, width:] = True
    positions = (valid.long().cumsum(dim=-1) - 1).clamp(min=0)  # [b, total]: a prompt's first token at 0
    # One end-of-sequence token is compared as a number (one op per step), several through isin.
    eos = eos_ids[0] if len(eos_ids) == 1 else torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    windows = [m.window for m in model.modules() if isinstance(m, Attention)]
    state = DecodeState(valid, windows, next(model.parameters()).dtype, filled_from=width)
    step_fn = _compiled_decode_step() if compile_decode else _decode_step
    out = torch.full((b, config.max_new_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    steps = 0
    with kv_caches(model, state):
        state.point(torch.arange(width, device=device))
        logits = _decode_step(model, tokens, positions[:, :width])  # [b, vocab]
        position = positions[:, width - 1:width] + 1  # [b, 1]
        for step in range(config.max_new_tokens):
            next_tokens = torch.where(done, pad_id, sample_next(logits, config, generator))
            out[:, step] = next_tokens
            steps = step + 1
            done |= next_tokens == eos if isinstance(eos, int) else torch.isin(next_tokens, eos)
            if step + 1 == config.max_new_tokens or ((step + 1) % check_every == 0 and bool(done.all())):
                break
            state.point_at(width + step)
            logits = step_fn(model, next_tokens[:, None], position)
            position = position + 1
    rows, truncated = [], []
    stops = set(eos_ids)
    for row in out[:, :steps].tolist():
        ends = [i for i, t in enumerate(row) if t in stops]
        rows.append(row[:ends[0] + 1] if ends else row)
        truncated.append(not ends)
    return Completions(rows, truncated)
