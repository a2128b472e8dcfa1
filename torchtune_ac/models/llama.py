"""A Llama-style decoder-only transformer, and the variants of it that are a flag away.

This file holds the model and nothing else: no activation checkpointing, no sharding, no config parsing.
Its parameter names follow the Hugging Face Llama layout one prefix away (see ``hf_adapter.py``), and its
rotary embedding uses the same "rotate half" convention as Hugging Face checkpoints, so weights load
without permutation.

A family that is a Llama variant (Qwen2's q/k/v biases, Qwen3's q/k norms, Gemma's ``(1 + w)`` norms, scaled
embeddings and GeGLU, Phi-3's partial rotary embeddings and LongRoPE) is a set of ``LlamaArgs`` flags. A family whose block differs in structure passes its own
block class to ``Llama`` (``models/families/gemma3.py``); the decoder around the blocks is shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from torchtune_ac.models.attention import (DocumentRuns, causal_attention, document_index, document_runs,
                                          document_starts)
from torchtune_ac.models.moe import GroupedExperts, MoE, MoEArgs


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (``rope_type: llama3`` in Hugging Face configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LinearRopeScaling:
    """Linear RoPE scaling (``rope_type: linear`` in Hugging Face configs): every frequency divided by ``factor``
    (Gemma 3's global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (``rope_type: longrope``, Phi-3's 128k models): each frequency divided by its own factor, from
    ``short_factor`` while a batch's positions stay within ``original_max_position_embeddings`` and from
    ``long_factor`` once one passes it (the whole batch switches, as transformers does), and cos/sin scaled by
    ``attention_factor``. ``max_position_embeddings``: the length the scaling extends to (131,072), which readers
    of config.json derive the attention factor from."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN RoPE scaling (``rope_type: yarn`` in Hugging Face configs, gpt-oss), as transformers computes it: each
    frequency interpolated (divided by ``factor``) or kept by a linear ramp between the dimensions where the
    original context length makes ``beta_slow`` and ``beta_fast`` rotations, and cos/sin scaled by
    ``attention_factor`` (by default ``0.1 * ln(factor) + 1``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: Optional[float] = None

    @property
    def resolved_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


# Attention of a layer, by the Hugging Face names (config.json ``layer_types``).
LAYER_TYPES = ("full_attention", "sliding_attention")
# MLP activations by their Hugging Face names (config.json ``hidden_act``): SwiGLU and GeGLU (tanh approximation).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class LlamaArgs:
    """Shape and behaviour of a Llama-style model.

    ``head_dim`` defaults to ``dim // n_heads``. Dropout defaults to 0.0 (the published models use none);
    it exists so that activation checkpointing can be shown to replay dropout masks exactly.

    The variant flags (each default is Llama's):

    - ``model_type``: the Hugging Face ``model_type`` of the family these arguments describe; generic code finds a
      model's family by it (``torchtune_ac.models.families``).
    - ``qkv_bias``: biases on the query, key and value projections (Qwen2).
    - ``qk_norm``: an RMSNorm over ``head_dim``, per head, on queries and keys before RoPE (Qwen3, Gemma 3).
    - ``norm_offset``: every RMSNorm scales by ``norm_offset + weight``, in float32 (Gemma's ``1 + w``, with weights
      initialised to 0); 0.0 scales by the weight after casting back, as Llama does.
    - ``norm_in_float32``: with ``norm_offset`` 0.0, every RMSNorm scales by its weight in float32, then casts back
      (gpt-oss).
    - ``scale_embeddings``: embeddings are multiplied by ``sqrt(dim)``, rounded to their dtype first (Gemma).
    - ``activation``: the MLP's gate activation, a key of ``ACTIVATIONS`` (``gelu_pytorch_tanh``: Gemma's GeGLU).
    - ``query_pre_attn_scalar``: attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` instead of
      ``head_dim ** -0.5`` (Gemma 2 and 3).
    - ``attn_logit_softcapping``: C, attention scores (after scaling) become ``C * tanh(score / C)`` before the
      mask and the softmax (Gemma 2; ``attention.py`` says which kernel does it).
    - ``final_logit_softcapping``: C, the logits become ``C * tanh(logits / C)`` (Gemma 2), also in a chunked
      loss (the output head is told C).
    - ``partial_rotary_factor``: RoPE rotates the first ``int(head_dim * partial_rotary_factor)`` dimensions of
      each head and passes the rest through (Phi-4-mini's 0.75).

    The attention pattern, per layer:

    - ``sliding_window``: W, the window of sliding-window layers: a query sees itself and the W - 1 tokens
      before it (of its own document).
    - ``layer_types``: each layer's attention, ``"full_attention"`` or ``"sliding_attention"`` (the Hugging Face
      names); None: every layer slides when ``sliding_window`` is set (Mistral 7B v0.1), else every layer is full.
    - ``sliding_rope_theta``: the RoPE base of sliding-window layers, which then use no RoPE scaling (Gemma 3's
      local layers); None: they use ``rope_theta`` and ``rope_scaling`` as full layers do.

    Mixture of experts: ``moe`` (``models/moe.py``): the layers it makes sparse have an ``MoE`` in place of the
    dense MLP (Qwen3-MoE, gpt-oss); None: every layer is dense.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_dim: int
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling | LinearRopeScaling | LongRopeScaling | YarnRopeScaling] = None
    tie_embeddings: bool = False
    head_dim: Optional[int] = None
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0
    model_type: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    norm_offset: float = 0.0
    norm_in_float32: bool = False
    scale_embeddings: bool = False
    activation: str = "silu"
    query_pre_attn_scalar: Optional[float] = None
    partial_rotary_factor: float = 1.0
    sliding_window: Optional[int] = None
    layer_types: Optional[tuple[str, ...]] = None
    sliding_rope_theta: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    moe: Optional[MoEArgs] = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "intermediate_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.head_dim is not None and self.head_dim <= 0:
            problems.append(f"head_dim={self.head_dim} must be positive")
        if not self.rope_theta > 0:
            problems.append(f"rope_theta={self.rope_theta} must be positive")
        if self.n_heads > 0 and self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim is None and self.n_heads > 0 and self.dim % self.n_heads:
            problems.append(f"dim={self.dim} must be a multiple of n_heads={self.n_heads} (or set head_dim)")
        for name in ("attn_dropout", "resid_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.activation not in ACTIVATIONS:
            problems.append(f"activation={self.activation!r} must be one of {', '.join(ACTIVATIONS)}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            problems.append(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be positive")
        problems += self._rope_problems()
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        problems += self._attention_pattern_problems()
        if self.moe is not None:
            problems += self.moe.problems()
        if problems:
            raise ValueError("invalid Llama model arguments: " + "; ".join(problems))

    def _rope_problems(self) -> list[str]:
        problems = []
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            return [f"partial_rotary_factor={self.partial_rotary_factor} must be in (0, 1]"]
        if self.n_heads > 0 and (self.rotary_dim < 2 or self.rotary_dim % 2):
            problems.append(f"partial_rotary_factor={self.partial_rotary_factor}: rotates {self.rotary_dim} of "
                            f"head_dim={self.resolved_head_dim} dimensions, must be a positive even number")
        if isinstance(self.rope_scaling, LongRopeScaling):
            scaling = self.rope_scaling
            for name in ("short_factor", "long_factor"):
                if self.n_heads > 0 and len(getattr(scaling, name)) != self.rotary_dim // 2:
                    problems.append(f"rope_scaling.{name} has {len(getattr(scaling, name))} entries, must have one "
                                    f"per rotated pair ({self.rotary_dim // 2})")
            if scaling.original_max_position_embeddings <= 0:
                problems.append(f"rope_scaling.original_max_position_embeddings="
                                f"{scaling.original_max_position_embeddings} must be positive")
            if not scaling.attention_factor > 0:
                problems.append(f"rope_scaling.attention_factor={scaling.attention_factor} must be positive")
        return problems

    def _attention_pattern_problems(self) -> list[str]:
        problems = []
        if self.sliding_window is not None and self.sliding_window <= 0:
            problems.append(f"sliding_window={self.sliding_window} must be positive")
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries, must have one per layer "
                                f"(n_layers={self.n_layers})")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                problems.append(f"layer_types: {', '.join(map(repr, unknown))} not one of {', '.join(LAYER_TYPES)}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                problems.append("layer_types has sliding_attention layers: set sliding_window")
        if self.sliding_rope_theta is not None:
            if not self.sliding_rope_theta > 0:
                problems.append(f"sliding_rope_theta={self.sliding_rope_theta} must be positive")
            if self.sliding_window is None:
                problems.append("sliding_rope_theta is set but no layer slides (sliding_window is not set)")
        return problems

    def window_of(self, layer: int) -> Optional[int]:
        """The sliding window of layer ``layer``'s attention, or None for full (causal) attention."""
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head RoPE rotates (transformers' ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.resolved_head_dim * self.partial_rotary_factor)


def compute_rope_inv_freq(
    head_dim: int, theta: float,
    scaling: Optional[RopeScaling | LinearRopeScaling | LongRopeScaling | YarnRopeScaling], long: bool = False,
) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, shape ``[head_dim // 2]``, float32, on the CPU (``head_dim``:
    the dimensions rotated, ``LlamaArgs.rotary_dim``).

    With a ``RopeScaling``, long wavelengths are divided by ``factor``, short ones are kept, and the band
    in between is interpolated smoothly (Llama 3.1); with a ``LinearRopeScaling`` every one is divided; with a
    ``LongRopeScaling`` each by its own factor, of ``long_factor`` when ``long``, else of ``short_factor``.
    ``YarnRopeScaling``, as transformers' YaRN.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    if isinstance(scaling, LongRopeScaling):
        factors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32, device="cpu")
        return 1.0 / (factors * theta**exponents)  # transformers' order of operations
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    if isinstance(scaling, YarnRopeScaling):
        return _yarn_inv_freq(head_dim, theta, scaling)
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: YarnRopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:  # the dimension where the original context turns this often
        return head_dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    kept = 1 - ramp  # the share of each frequency extrapolated (kept as it is)
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - kept) + (1.0 / pos_freqs) * kept


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, n_heads, s, head_dim]; cos, sin: [b, 1, s, rotary_dim]
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]  # partial rotary: the rest passes through
    return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32.

    With ``offset`` 0.0 it casts back, then scales by the weight (as Hugging Face Llama and Qwen do); otherwise, or
    ``in_float32``, it scales by ``offset + weight`` in float32, then casts back (as Gemma does, with offset 1; as
    gpt-oss does, with offset 0). Either way a freshly
    initialised norm scales by 1.
    """

    def __init__(self, dim: int, eps: float, offset: float = 0.0, in_float32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.in_float32 = in_float32 or bool(offset)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.in_float32:
            return (x * (self.offset + self.weight.float())).to(input_dtype)
        return self.weight * x.to(input_dtype)

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)


class Attention(nn.Module):
    """Grouped-query self-attention with rotary embeddings; the attention itself is ``causal_attention``
    (``attention.py``): one causal call, or one per document of a packed batch, within ``window`` tokens when
    it is set (sliding-window attention)."""

    def __init__(self, args: LlamaArgs, window: Optional[int] = None) -> None:
        super().__init__()
        self.window = window
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.resolved_head_dim
        self.dropout = args.attn_dropout
        self.q_proj = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=args.qkv_bias)
        self.k_proj = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)
        # Per head, over head_dim: one weight of head_dim shared by every head (Qwen3, Gemma 3).
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.scale = None if args.query_pre_attn_scalar is None else args.query_pre_attn_scalar**-0.5
        self.softcap = args.attn_logit_softcapping
        self.sinks: Optional[nn.Parameter] = None  # a family's learned sink logit per head (gpt-oss)
        # Set while generating (``generation/kv_cache.py``): the keys and values of earlier positions.
        self.kv_cache: Optional[Any] = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Optional[DocumentRuns]
    ) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads counted from the projections: under tensor parallelism each rank's projections give its own heads
        # only (n_heads / degree of them; see models/tensor_parallel.py).
        together = project_together(x, self.q_proj, self.k_proj, self.v_proj)
        q, k, v = together if together is not None else (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        q = q.view(b, s, -1, self.head_dim)  # [b, s, n_heads, hd]
        k = k.view(b, s, -1, self.head_dim)  # [b, s, n_kv, hd]
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, n_kv, s, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [b, n_heads, s, hd]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [b, n_kv, s, hd]
        if self.kv_cache is not None:
            out = self.kv_cache.attend(q, k, v, scale=self.scale)  # [b, s, n_heads, hd]
            return self.o_proj(out.reshape(b, s, -1))
        out = causal_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, runs=runs, scale=self.scale, window=self.window,
            softcap=self.softcap, sinks=self.sinks,
        )  # [b, s, n_heads, hd]
        return self.o_proj(out.reshape(b, s, -1))  # [b, s, n_heads * hd] in

    def attends_plainly(self) -> bool:
        """Whether its attention is plain causal attention (no window, cap, sinks, dropout or KV cache): what
        ``forward_rows`` computes."""
        return (self.window is None and self.softcap is None and self.sinks is None and self.kv_cache is None
                and not (self.training and self.dropout))

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Optional[DocumentRuns],
                     rows: torch.Tensor) -> torch.Tensor:
        """``forward``'s output at ``rows`` only (``[n]`` indices into the ``b * s`` flattened tokens, ascending):
        queries, attention and the output projection for those rows, keys and values for every token. Plain
        attention only (``attends_plainly``).

        Returns:
            ``[n, dim]``.
        """
        b, s, _ = x.shape
        n = rows.numel()
        q = self.q_proj(x.flatten(0, 1).index_select(0, rows)).view(n, -1, self.head_dim)  # [n, n_heads, hd]
        k = self.k_proj(x).view(b * s, -1, self.head_dim)  # [b * s, n_kv, hd]
        v = self.v_proj(x).view(b * s, -1, self.head_dim).transpose(0, 1).unsqueeze(0)  # [1, n_kv, b * s, hd]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)

        def table(t: torch.Tensor) -> torch.Tensor:  # [b, 1, s, rd] -> [1, 1, b * s, rd]
            return t.expand(b, -1, -1, -1).reshape(1, 1, b * s, -1)

        q = apply_rope(q.transpose(0, 1).unsqueeze(0), table(cos)[:, :, rows], table(sin)[:, :, rows])  # [1, H, n, hd]
        k = apply_rope(k.transpose(0, 1).unsqueeze(0), table(cos), table(sin))  # [1, n_kv, b * s, hd]
        # A row sees the tokens of its own sequence (document, or batch row) up to itself: one call over all keys.
        tokens = torch.arange(b * s, device=x.device)
        sequence = tokens // s if runs is None else document_index(runs, b, s).flatten()
        allowed = (tokens <= rows.unsqueeze(1)) & (sequence == sequence[rows].unsqueeze(1))  # [n, b * s]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=k.shape[1] != q.shape[1],
                                             scale=self.scale)  # [1, n_heads, n, hd]
        return self.o_proj(out.squeeze(0).transpose(0, 1).reshape(n, -1))


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))`` (SwiGLU with silu, GeGLU with gelu)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        together = project_together(x, self.gate_proj, self.up_proj)
        if together is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        gate, up = together
        return self.down_proj(self.act(gate) * up)


def project_together(x: torch.Tensor, *linears: nn.Module) -> Optional[tuple[torch.Tensor, ...]]:
    """``linear(x)`` for each of ``linears``, which share their input, computed together where the first one's class
    offers it (``forward_shared``: adapted linears, ``lora/mechanism.py``, whose adapters then read ``x`` once);
    None otherwise (a plain linear): the caller calls each, as it always has."""
    shared = getattr(linears[0], "forward_shared", None)
    return shared(x, linears) if shared is not None else None


class TransformerBlock(nn.Module):
    """Pre-norm block: ``h = x + drop(attn(norm(x)))``; ``out = h + drop(mlp(norm(h)))``. A mixture-of-experts
    block returns ``(out, router logits, counts)`` (``MoE``), which ``Llama`` keeps on the layer.

    Args:
        args: the model's arguments.
        window: the sliding window of this block's attention (``args.window_of(layer)``); None for full.
        layer: the block's index: its MLP is a mixture of experts where ``args.moe`` makes that layer sparse.
    """

    def __init__(self, args: LlamaArgs, window: Optional[int] = None, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset, args.norm_in_float32)
        self.attn = Attention(args, window)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset, args.norm_in_float32)
        self.mlp = build_mlp(args, layer)
        self.resid_dropout = nn.Dropout(args.resid_dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Optional[DocumentRuns] = None,
        rows: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``[b, s, dim]`` -> ``[b, s, dim]``; with ``rows`` (``[n]`` ascending indices into the ``b * s``
        flattened tokens) the output at those rows only, ``[n, dim]``: where nothing after this block reads the
        others (the last block, before a loss over the targets), their queries, attention output and MLP are never
        computed. A block that is not plain (``computes_rows``) computes every row and returns those (a mixture of
        experts is never given ``rows``: ``last_block_rows``)."""
        if rows is not None:
            if not self.computes_rows():
                return self.forward(x, cos, sin, runs).flatten(0, 1).index_select(0, rows)
            h = x.flatten(0, 1).index_select(0, rows) + self.attn.forward_rows(self.attn_norm(x), cos, sin, runs, rows)
            return h + self.mlp(self.mlp_norm(h))
        h = x + self.resid_dropout(self.attn(self.attn_norm(x), cos, sin, runs))
        if isinstance(self.mlp, MoE):  # its output, and its router's logits and counts, handed on to the decoder
            out, logits, counts = self.mlp(self.mlp_norm(h))
            return h + self.resid_dropout(out), logits, counts
        return h + self.resid_dropout(self.mlp(self.mlp_norm(h)))

    # Set by ``parallel/tensor_parallel.py``: the block's input and output are split along the sequence.
    tensor_parallel = False

    def computes_rows(self) -> bool:
        """Whether ``forward(rows=)`` computes those rows only: plain attention (``Attention.attends_plainly``), a
        dense MLP, no residual dropout in training, no tensor parallelism."""
        return (type(self).forward is TransformerBlock.forward  # a subclass's own forward takes no rows
                and self.attn.attends_plainly() and not isinstance(self.mlp, MoE)
                and not (self.training and self.resid_dropout.p) and not self.tensor_parallel)


def last_block_rows(head: Any, layer: nn.Module, seq_len: int) -> Optional[torch.Tensor]:
    """The rows the last block ``layer`` need compute, for a head that reads the targets only (``TargetHead``): its
    ``target_rows()`` where the block computes those rows alone (``TransformerBlock.computes_rows``) and they are
    at most ``seq_len`` (the row length), else None (every row: the head then selects them).

    ``Attention.forward_rows`` scores each of the n rows against every one of the ``b * s`` tokens (one masked
    call): at most as many scores as the whole block's ``b * s * s`` while n <= s. Beyond that (a batch of several
    rows with most positions targets, the memory planner's worst case) the whole block runs. A compiled block is
    given every row: the targets' count changes from batch to batch, and each count would be a graph of its own."""
    if not isinstance(head, TargetHead) or not isinstance(layer, TransformerBlock) or not layer.computes_rows():
        return None
    if getattr(layer, "_compiled_call_impl", None) is not None:
        return None
    rows = head.target_rows()
    return rows if rows is not None and rows.numel() <= seq_len else None


def build_mlp(args: LlamaArgs, layer: int) -> nn.Module:
    """Layer ``layer``'s MLP: an ``MoE`` where ``args.moe`` makes the layer sparse, else the dense ``MLP``."""
    if args.moe is not None and args.moe.is_sparse(layer):
        return MoE(args.dim, args.moe)
    return MLP(args.dim, args.intermediate_dim, args.activation)


def positions_from_document_ids(document_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its own document: ``[b, s]`` document ids -> ``[b, s]`` positions.

    Documents are contiguous runs of equal ids; positions restart at 0 where the id changes.
    """
    b, s = document_ids.shape
    idx = torch.arange(s, device=document_ids.device).expand(b, s)
    start_idx = torch.where(document_starts(document_ids), idx, torch.zeros_like(idx))
    return idx - torch.cummax(start_idx, dim=1).values


@runtime_checkable
class TargetHead(Protocol):
    """An output head that reads the final hidden states at its targets only: ``target_rows()`` names them (``[n]``
    ascending indices into the ``b * s`` flattened tokens, or None to be given every row), and the head is then
    called with the hidden states of those rows, ``[n, dim]`` (``memory/chunked_loss.py``'s ``ChunkedCrossEntropy``).
    A model may then compute its last block at those rows only (``TransformerBlock.forward``'s ``rows``)."""

    def target_rows(self) -> Optional[torch.Tensor]: ...


class BlockClass(Protocol):
    """What ``Llama`` needs of a block class: built from the arguments, the block's attention window and its
    index, called as ``TransformerBlock`` is."""

    def __call__(self, args: LlamaArgs, window: Optional[int], layer: int) -> nn.Module: ...


class OutputProjection(nn.Linear):
    """The output layer: ``x @ weight.T``, or ``head(x, weight)`` when a head replaces the projection.

    With ``softcap`` C the logits are ``C * tanh((x @ weight.T) / C)`` (Gemma 2), in their dtype as transformers
    computes them, and a head is called as ``head(x, weight, softcap=C)``: it must apply the same cap.

    The head is applied inside this module's forward so that whatever wraps the module's calls (FSDP2 gathering
    the weight of a group holding the final norm and this layer) sees the layer run on either path.
    """

    # Whether ``forward`` takes a loss head (an adapter's output projection does not: ``lora/mechanism.py``).
    takes_head = True

    def __init__(self, in_features: int, out_features: int, softcap: Optional[float] = None) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.softcap = softcap

    def forward(self, x: torch.Tensor, head: Optional[Callable[..., torch.Tensor]] = None) -> torch.Tensor:
        if head is not None:
            return head(x, self.weight) if self.softcap is None else head(x, self.weight, softcap=self.softcap)
        logits = super().forward(x)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap


class Llama(nn.Module):
    """Token embedding -> ``layers`` (``nn.ModuleList`` of blocks) -> final norm -> output.

    ``forward(tokens[b, s]) -> logits[b, s, vocab]``. Pass ``document_ids[b, s]`` for packed sequences:
    tokens then attend only within their own document (nothing is computed across documents), and rotary
    positions restart at each document.

    Args:
        args: the model's arguments.
        block: the block class, ``TransformerBlock`` unless the family's block differs in structure; it is
            called as ``block(args, args.window_of(layer), layer)`` and its instances as ``TransformerBlock``'s are.
    """

    def __init__(self, args: LlamaArgs, block: BlockClass = TransformerBlock) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(block(args, args.window_of(layer), layer) for layer in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset, args.norm_in_float32)
        self.output = OutputProjection(args.dim, args.vocab_size, softcap=args.final_logit_softcapping)
        self.tie_weights()
        # RoPE inverse frequencies ``[head_dim // 2]`` float32, on the model's device: a forward reads them without
        # a copy from the host. Not persistent (no checkpoint holds them), and recomputed from the arguments
        # whenever the module's tensors are moved, cast or re-allocated (``_apply``), so ``to(dtype)`` never
        # rounds them and ``to_empty`` after a meta-device build never leaves them uninitialised.
        self.register_buffer("rope_inv_freq", torch.empty(0), persistent=False)
        if isinstance(args.rope_scaling, LongRopeScaling):
            self.register_buffer("long_rope_inv_freq", torch.empty(0), persistent=False)
        if args.sliding_rope_theta is not None:
            self.register_buffer("sliding_rope_inv_freq", torch.empty(0), persistent=False)
        self._reset_rope_frequencies()

    def _rope_frequencies(self) -> dict[str, torch.Tensor]:
        """Each RoPE buffer's values, computed on the CPU in float32 (the same bits on any device)."""
        args = self.args
        frequencies = {"rope_inv_freq": compute_rope_inv_freq(args.rotary_dim, args.rope_theta, args.rope_scaling)}
        if isinstance(args.rope_scaling, LongRopeScaling):
            frequencies["long_rope_inv_freq"] = compute_rope_inv_freq(args.rotary_dim, args.rope_theta,
                                                                      args.rope_scaling, long=True)
        if args.sliding_rope_theta is not None:
            frequencies["sliding_rope_inv_freq"] = compute_rope_inv_freq(args.rotary_dim, args.sliding_rope_theta, None)
        return frequencies

    def _reset_rope_frequencies(self) -> None:
        for name, values in self._rope_frequencies().items():
            device = getattr(self, name).device
            # On the meta device only the shape matters (a model built there holds no values).
            setattr(self, name, values.to(device) if device.type != "meta" else torch.empty_like(values, device="meta"))

    def _apply(self, fn, recurse: bool = True):
        # ``to``, ``to_empty``, ``cuda``, ``half`` all go through here: move the buffers, then put back their
        # float32 values (``to(bfloat16)`` would round them; ``to_empty`` would leave them unset).
        super()._apply(fn, recurse)
        self._reset_rope_frequencies()
        return self

    def tie_weights(self) -> None:
        """Share the output projection with the embedding when ``args.tie_embeddings`` (again after
        ``to_empty``, which allocates the two separately)."""
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, sliding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables ``[b, 1, s, rotary_dim]`` for integer ``positions[b, s]``, of the sliding-window layers'
        RoPE when ``sliding`` (``args.sliding_rope_theta``, where it is set).

        The frequencies are the model's buffers, on its device: nothing is copied from the host per call. LongRoPE
        picks its long factors when the batch's longest position passes the original length, on the device
        (``torch.where``, no host synchronisation).
        """
        sliding = sliding and self.args.sliding_rope_theta is not None
        scaling = None if sliding else self.args.rope_scaling
        inv_freq = self.sliding_rope_inv_freq if sliding else self.rope_inv_freq  # [rd/2], float32
        if isinstance(scaling, LongRopeScaling):
            long = positions.max() + 1 > scaling.original_max_position_embeddings
            inv_freq = torch.where(long, self.long_rope_inv_freq, inv_freq)
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [b, s, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, rd]
        cos, sin = emb.cos(), emb.sin()
        if isinstance(scaling, LongRopeScaling):
            cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
        elif isinstance(scaling, YarnRopeScaling):  # YaRN scales the attention through cos/sin (in float32)
            cos, sin = cos * scaling.resolved_attention_factor, sin * scaling.resolved_attention_factor
        return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)

    def forward(
        self,
        tokens: torch.Tensor,
        document_ids: Optional[torch.Tensor] = None,
        head: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
        document_lengths: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Logits ``[b, s, vocab]`` of ``tokens[b, s]``, or ``head(hidden, output_weight)`` when a head is given.

        ``document_lengths`` (with ``document_ids``): the packed documents' lengths, row after row, a CPU tensor
        counted where the batch was built (``collate_batch``); without it they are read back from
        ``document_ids``, a host synchronisation on a GPU (``attention.document_runs``).

        ``head`` replaces the output projection: it receives the final norm's output ``[b, s, dim]`` and the
        projection's weight ``[vocab, dim]`` (the embedding, when tied), and ``softcap=C`` where the logits are
        soft-capped (``args.final_logit_softcapping``), e.g. to compute a loss chunk by chunk
        without ever materialising the logits. It runs inside this forward, where a sharded model's weights
        are gathered.

        ``positions`` ``[b, s]``: each token's RoPE position, where generation decodes with a KV cache.
        """
        b, s = tokens.shape
        if positions is not None:
            runs = None
        elif document_ids is None:
            positions = torch.arange(s, device=tokens.device).expand(b, s)
            runs = None
        else:
            positions = positions_from_document_ids(document_ids)
            runs = document_runs(document_ids, document_lengths)  # once per forward, shared by every layer
        h = self.tok_embeddings(tokens)  # [b, s, dim]
        if self.args.scale_embeddings:
            # sqrt(dim) rounded to the embedding's dtype first, as Gemma's checkpoints were trained with.
            h = h * torch.tensor(self.args.dim**0.5, dtype=h.dtype).item()
        full = self.rope_cos_sin(positions, h.dtype)
        # Sliding-window layers may have a RoPE of their own (Gemma 3's local layers).
        sliding = full if self.args.sliding_rope_theta is None else self.rope_cos_sin(positions, h.dtype, sliding=True)
        # The text decoders compute every row of their last block: ``last_block_rows``'s one masked attention call
        # (scores of the targets against every token) is left to the vision-language decoders, whose labelled rows
        # are a small share of an image-heavy batch.
        for index, layer in enumerate(self.layers):
            cos, sin = sliding if self.args.window_of(index) is not None else full
            h = layer(h, cos, sin, runs)
            if isinstance(h, tuple):  # a mixture-of-experts block: its output, and what its router did
                h, logits, counts = h
                layer.mlp.record_router_output(logits, counts)
        return self.output(self.norm(h), head)  # [b, s, vocab], or the head's result

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Initialise every parameter in place (normal(0, std) for matrices, zeros for biases, norms to scale by
        1)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, GroupedExperts):  # stacked experts: weights normal, biases zero
                for name, param in module.named_parameters():
                    if name.endswith("bias"):
                        nn.init.zeros_(param)
                    else:
                        nn.init.normal_(param, mean=0.0, std=std)
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.normal_(module.sinks, mean=0.0, std=std)  # gpt-oss's attention sinks

    @torch.no_grad()
    def init_parameter_(self, name: str, tensor: torch.Tensor, generator: torch.Generator,
                        std: float = 0.02) -> None:
        """Fill ``tensor`` (the full shape of parameter ``name``, anywhere) as ``init_weights`` initialises that
        parameter, drawing from ``generator``: a builder that materialises one parameter at a time (each from a
        generator of its own) gets the same values on any device and for any sharding.

        Raises:
            ValueError: ``name`` is no parameter of a kind ``init_weights`` knows.
        """
        owner_name, _, attr = name.rpartition(".")
        owner = self.get_submodule(owner_name)
        if isinstance(owner, RMSNorm) and attr == "weight":
            tensor.fill_(1.0 - owner.offset)
        elif isinstance(owner, (nn.Linear, nn.Embedding)) and attr == "weight":
            tensor.normal_(mean=0.0, std=std, generator=generator)
        elif isinstance(owner, nn.Linear) and attr == "bias":
            tensor.zero_()
        elif isinstance(owner, Attention) and attr == "sinks":
            tensor.normal_(mean=0.0, std=std, generator=generator)
        elif isinstance(owner, GroupedExperts) and attr.endswith("bias"):
            tensor.zero_()
        elif isinstance(owner, GroupedExperts):
            tensor.normal_(mean=0.0, std=std, generator=generator)
        else:
            raise ValueError(f"no initialisation rule for parameter {name} of {type(owner).__name__}")
