"""Causal self-attention for plain and packed batches: pure functions, no module state.

A packed row holds several documents, each a contiguous run of equal ``document_ids``. Attention is causal
within each document and absent across documents, so it is computed one document at a time: no query-key
pair that crosses a document boundary is ever computed, no ``[b, s, s]`` mask is built, and grouped K/V are
handed to the kernel as they are (``enable_gqa``), never copied per query head.

``document_runs`` finds the documents once per forward (``Llama.forward``); every layer then calls
``causal_attention`` with the same ``DocumentRuns``. Kernels:

* no ``document_ids``: one causal ``scaled_dot_product_attention`` call over the whole batch;
* packed, CUDA, fp16/bf16, no attention dropout: one ``torch.nn.attention.varlen.varlen_attn`` call (Flash
  Attention over all documents of the batch at once, from the same offsets);
* packed otherwise (CPU; CUDA with fp32 or attention dropout, which ``varlen_attn`` does not do; a torch whose
  ``varlen_attn`` lacks what the call needs, announced once, see ``VarlenSupport``; grouped K/V on a torch whose
  ``varlen_attn`` has no ``enable_gqa=`` are copied per query head and still take the varlen call): one causal
  ``scaled_dot_product_attention`` call per document. Splitting the flattened batch with ``split`` keeps the
  backward to a single concatenation of the per-document gradients.

Sliding-window attention (a ``window`` W: a query sees itself and the W - 1 tokens before it, within its
document) takes the same paths: ``varlen_attn`` with ``window_size=(W - 1, 0)``, and elsewhere the same
``scaled_dot_product_attention`` call with a band mask ``[L, L]`` for a sequence (row or document) longer than W.
A sequence of at most W tokens is plain causal attention, and is computed exactly as without a window.

Soft-capped attention (``softcap`` C: scores become ``C * tanh(score / C)`` before the mask and the softmax,
Gemma 2) and attention sinks (``sinks``: one more logit per head in its softmax, valued zero, gpt-oss) change the
scores in ways no SDPA or Flash Attention kernel of torch takes, so they share paths of their own:

* CUDA, no attention dropout: FlexAttention (``flex_explicit_attention``, compiled once per process) with the cap
  as its ``score_mod``, the causal, sliding-window and document structure as its block mask, packed or not, and
  the sinks applied to its output through its log-sum-exp: one fused call over the batch, nothing ``[s, s]`` kept;
* otherwise (CPU, where torch 2.13's FlexAttention has no backward; attention dropout, which it lacks): the
  scores computed explicitly (``_explicit_attention``: scale, cap, mask, sinks, float32 softmax, as transformers'
  eager Gemma 2 and gpt-oss do), over the whole row, or one document at a time for packed rows. It holds
  ``[heads, L, L]`` scores per sequence of L tokens, as SDPA's math kernel does; grouped K/V are not copied.

Under ``torch.compile`` (``block.compile()``) the per-document loop runs eagerly (``torch.compiler.disable``):
its trip count and slice sizes change with every batch, so tracing it would recompile per batch. Without AC a
block then compiles into two graphs around it, and nothing recompiles as document layouts change. A block with
AC cannot be split inside its checkpoint, so Dynamo runs the whole checkpointed block eagerly on packed
batches (exactly as in eager mode, per-op policy and dropout replay included); unpacked batches and the varlen
path, which is traced whole, stay compiled.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

try:
    from torch.nn.attention.varlen import varlen_attn  # torch 2.9 or newer
except ImportError:
    varlen_attn = None

log = logging.getLogger(__name__)

# Flash Attention (behind ``varlen_attn``) takes half-precision inputs only, has no dropout, and needs an
# Ampere or newer GPU.
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class VarlenSupport:
    """What this torch's ``varlen_attn`` can do, read from its signature (``detect_varlen_support``).

    Attributes:
        present: ``torch.nn.attention.varlen`` exists (torch 2.9 or newer).
        window_size: it takes ``window_size=``, the only way this module asks it for causal (and sliding-window)
            attention (added in early 2026; before, ``is_causal=``).
        enable_gqa: it takes ``enable_gqa=``, grouped K/V as they are (torch 2.12 or newer).
    """

    present: bool
    window_size: bool
    enable_gqa: bool

    def lacks(self, *, gqa: bool) -> tuple[str, ...]:
        """What a call for causal attention needs and this torch lacks; () if nothing. Grouped K/V (``gqa``) need
        nothing more: without ``enable_gqa=`` they are copied per query head for the call (``_varlen_kv``)."""
        if not self.present:
            return ("torch.nn.attention.varlen",)
        return () if self.window_size else ("varlen_attn(window_size=)",)


def detect_varlen_support(function: Optional[Callable[..., Any]]) -> VarlenSupport:
    """Read ``function``'s (``varlen_attn``'s, or None where torch has none) keyword arguments."""
    if function is None:
        return VarlenSupport(present=False, window_size=False, enable_gqa=False)
    parameters = inspect.signature(function).parameters
    return VarlenSupport(present=True, window_size="window_size" in parameters, enable_gqa="enable_gqa" in parameters)


VARLEN_SUPPORT = detect_varlen_support(varlen_attn)
# FlexAttention as soft-capped attention runs it on CUDA: compiled (uncompiled it scores every query-key pair,
# unfused); compiled lazily at the first call, with dynamic shapes once a second row length is seen (batches are
# padded to their longest sample, so lengths vary).
_COMPILED_FLEX_ATTENTION = torch.compile(flex_attention)
# The op behind ``varlen_attn`` (for per-op AC's policy), where torch has it.
VARLEN_OPS = frozenset({torch.ops.torch_attn._varlen_attn.default}) if VARLEN_SUPPORT.present else frozenset()


@torch.compiler.disable
@functools.lru_cache(maxsize=None)
def _announce_per_document_fallback(missing: tuple[str, ...]) -> None:
    """Say once per process (per missing set) that packed batches on this GPU take the slower, exact path."""
    log.warning("torch %s lacks %s: packed batches use one attention call per document (the same result, slower; "
                "torch 2.12 or newer has all of varlen_attn)", torch.__version__, " and ".join(missing))


@dataclass(frozen=True, eq=False)
class DocumentRuns:
    """The documents of a packed batch ``[b, s]``, in order over its ``b * s`` flattened tokens.

    Attributes:
        lengths: ``[n_documents]`` int64 on the CPU, the number of tokens of each document, row after row (every
            row starts a new document); they sum to ``b * s``. A tensor, not a tuple: Dynamo guards on a tuple's
            length, so a compiled block given a new number of documents would recompile for every batch (seen
            on torch 2.11, where the checkpoint around a block lifts every field of its inputs), while a tensor's
            size becomes dynamic after one recompile.
        cu_seqlens: ``[len(lengths) + 1]`` int32 offsets where each document starts, then ``b * s``, on the
            batch's device (the form variable-length attention takes).
        max_length: the longest document's length.
        varlen_device: the batch is on a GPU that runs ``varlen_attn`` (CUDA, compute capability 8.0 or more).

    Compiled code reads only ``cu_seqlens``, ``max_length`` and ``varlen_device`` (the varlen path): reading
    ``lengths`` there would make every batch's document lengths a guard, recompiling per batch.
    """

    lengths: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    varlen_device: bool


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: True where a document starts (each row's first token, and wherever the id changes).

    A document is a contiguous run of equal ids: a run that repeats an earlier, non-adjacent run's id is a
    document of its own.
    """
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def document_runs(document_ids: torch.Tensor, lengths: Optional[torch.Tensor] = None) -> DocumentRuns:
    """The documents of ``document_ids[b, s]``.

    Args:
        document_ids: ``[b, s]`` document ids, on the batch's device.
        lengths: the documents' lengths, row after row, as the collate code counted them on the host (a CPU
            int64 tensor, ``collate_batch``'s ``document_lengths``): nothing is read back from the device. None:
            found from ``document_ids``, which on a GPU costs host synchronisations (their lengths must be
            Python ints).

    Returns:
        Their lengths and offsets over the flattened batch.

    Raises:
        ValueError: ``lengths`` that do not add up to the batch's ``b * s`` tokens, or are not on the CPU.
    """
    device = document_ids.device
    if lengths is None:
        starts = document_starts(document_ids).flatten()  # [b * s]
        end = torch.full((1,), starts.numel(), dtype=torch.long, device=device)
        offsets = torch.cat([starts.nonzero().flatten(), end])  # [n_documents + 1]
        host_lengths = tuple(offsets.diff().tolist())
        cu_seqlens = offsets.to(torch.int32)
    else:
        if lengths.device.type != "cpu":
            raise ValueError(f"document lengths must be on the CPU (reading them from {lengths.device} would wait "
                             "for it), found them there")
        host_lengths = tuple(lengths.tolist())
        if sum(host_lengths) != document_ids.numel():
            raise ValueError(f"document lengths add up to {sum(host_lengths)} tokens, the batch has "
                             f"{document_ids.numel()}")
        # [n_documents + 1], copied to the device without waiting for it.
        cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).to(device, non_blocking=True)
    return DocumentRuns(
        lengths=torch.tensor(host_lengths, dtype=torch.long),
        cu_seqlens=cu_seqlens,
        max_length=max(host_lengths),
        varlen_device=device.type == "cuda" and torch.cuda.get_device_capability(device) >= _VARLEN_MIN_CAPABILITY,
    )


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float,
    runs: Optional[DocumentRuns],
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention, within each document when ``runs`` is given, and within ``window`` tokens when set.

    Args:
        q: queries ``[b, n_heads, s, head_dim]``.
        k, v: keys and values ``[b, n_kv_heads, s, head_dim]`` (``n_heads`` a multiple of ``n_kv_heads``).
        dropout_p: attention dropout probability (0.0 outside training).
        runs: the batch's documents from ``document_runs``, or None for one sequence per row.
        scale: the factor scores are multiplied by; None for ``head_dim ** -0.5``.
        window: W, for sliding-window attention: a query sees itself and the W - 1 tokens before it; None: every
            earlier token (of its document).
        softcap: C, for soft-capped scores ``C * tanh(score * scale / C)``; None: plain scores.
        sinks: ``[n_heads]`` attention sinks (gpt-oss): one more logit per head in its softmax, valued zero, so a
            head may attend to nothing; None: none.

    Returns:
        ``[b, s, n_heads, head_dim]``.
    """
    gqa = k.shape[1] != q.shape[1]
    explicit = dict(softcap=softcap, sinks=sinks) if softcap is not None or sinks is not None else None
    if explicit is not None and q.is_cuda and dropout_p == 0.0:
        return flex_explicit_attention(q, k, v, runs=runs, gqa=gqa, scale=scale, window=window, **explicit)
    if runs is None:
        kernel = _causal_sdpa if explicit is None else functools.partial(_explicit_attention, **explicit)
        out = kernel(q, k, v, dropout_p=dropout_p, gqa=gqa, scale=scale, window=window)
        return out.transpose(1, 2)  # [b, s, n_heads, hd]
    if explicit is None and runs.varlen_device and dropout_p == 0.0 and q.dtype in _VARLEN_DTYPES:
        missing = VARLEN_SUPPORT.lacks(gqa=gqa)
        if not missing:
            return _varlen_document_attention(q, k, v, runs, gqa, scale, window)
        _announce_per_document_fallback(missing)
    return _per_document_attention(q, k, v, runs=runs, dropout_p=dropout_p, gqa=gqa, scale=scale, window=window,
                                   **(explicit or {}))


def _causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float,
    gqa: bool,
    scale: Optional[float],
    window: Optional[int],
) -> torch.Tensor:
    """One ``scaled_dot_product_attention`` call over sequences ``[..., L, hd]``: causal, and within ``window``
    tokens when the sequences are longer than it (a band mask ``[L, L]``)."""
    length = q.shape[-2]
    if window is None or length <= window:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, enable_gqa=gqa,
                                              scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=_causal_mask(length, window, q.device),
                                          dropout_p=dropout_p, enable_gqa=gqa, scale=scale)


def _causal_mask(length: int, window: Optional[int], device: torch.device) -> torch.Tensor:
    """``[L, L]`` booleans, True where a query may attend a key: at or before it, and within ``window`` tokens."""
    position = torch.arange(length, device=device)
    behind = position.unsqueeze(1) - position.unsqueeze(0)  # [L, L]: query index - key index
    return behind >= 0 if window is None else (behind >= 0) & (behind < window)


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float,
    gqa: bool,
    scale: Optional[float],
    window: Optional[int],
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal attention over sequences ``[b, heads, L, hd]`` with the scores computed explicitly: scale, the cap
    ``C * tanh(score / C)`` with ``softcap``, the causal (and band) mask, each head's sink logit joined to its row
    with ``sinks``, a float32 softmax, dropout, then the values (transformers' eager Gemma 2 and gpt-oss, op for op).
    Grouped K/V are never copied: each K/V head's query heads are stacked along the rows of one matmul."""
    b, n_heads, length, hd = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv  # query head h reads K/V head h // group (SDPA's enable_gqa grouping)
    q = q.reshape(b, n_kv, group * length, hd)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (hd**-0.5 if scale is None else scale)  # [b, n_kv, group*L, L]
    scores = scores.view(b, n_kv, group, length, length)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~_causal_mask(length, window, q.device), float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.to(scores.dtype).view(1, n_kv, group, 1, 1).expand(b, n_kv, group, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    out = torch.matmul(probs.reshape(b, n_kv, group * length, length), v)  # [b, n_kv, group * L, hd]
    return out.view(b, n_heads, length, hd)


def document_index(runs: DocumentRuns, b: int, s: int) -> torch.Tensor:
    """``[b, s]`` int32: the index of each token's document in ``runs`` (found on the device, no sync)."""
    tokens = torch.arange(b * s, dtype=torch.int32, device=runs.cu_seqlens.device)
    return (torch.searchsorted(runs.cu_seqlens, tokens, right=True) - 1).view(b, s)


@torch.compiler.disable
@functools.lru_cache(maxsize=8)
def _flex_block_mask(runs: Optional[DocumentRuns], window: Optional[int], b: int, s: int, device: torch.device):
    """The block mask of causal attention (within ``window``, within each document of ``runs``), built once per
    forward and shared by its layers (``runs`` is one object per forward; an unpacked shape is reused)."""
    document = None if runs is None else document_index(runs, b, s)

    def mask_mod(batch, head, q_index, kv_index):
        allowed = q_index >= kv_index
        if window is not None:
            allowed = allowed & (q_index - kv_index < window)
        if document is not None:
            allowed = allowed & (document[batch, q_index] == document[batch, kv_index])
        return allowed

    return create_block_mask(mask_mod, None if document is None else b, None, s, s, device=device)


def flex_explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    runs: Optional[DocumentRuns],
    gqa: bool,
    scale: Optional[float],
    window: Optional[int],
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    kernel: Optional[Callable[..., torch.Tensor]] = None,
) -> torch.Tensor:
    """``_explicit_attention`` as one FlexAttention call over the batch (shapes as in ``causal_attention``, no
    dropout): the cap is its ``score_mod``, the causal, window and document structure its block mask, and the
    sinks rescale its output by its log-sum-exp.

    Args:
        kernel: the ``flex_attention`` to call; None: the compiled one (``kernel=flex_attention`` runs it
            uncompiled, e.g. to check the masks forward on a CPU, where FlexAttention has no backward).
    """
    b, n_heads, s, hd = q.shape

    def score_mod(score, batch, head, q_index, kv_index):
        return torch.tanh(score / softcap) * softcap

    block_mask = _flex_block_mask(runs, window, b, s, q.device)
    options = dict(score_mod=None if softcap is None else score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    call = kernel or _COMPILED_FLEX_ATTENTION
    if sinks is None:
        out = call(q, k, v, **options)  # [b, n_heads, s, hd]
    else:
        out, aux = call(q, k, v, return_aux=AuxRequest(lse=True), **options)
        # A head's sink, one more logit of its softmax valued zero, takes its share from every key's: what is left
        # of the output is exp(lse) / (exp(lse) + exp(sink)), in float32.
        left = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype).view(1, n_heads, 1))  # [b, n_heads, s]
        out = (out * left.unsqueeze(-1)).to(q.dtype)
    return out.transpose(1, 2)  # [b, s, n_heads, hd]


def _as_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[b, heads, s, hd]`` -> ``[b * s, heads, hd]``: a view when the tensor came from ``[b, s, heads * hd]``
    projections (as in ``Attention``), else a copy."""
    b, heads, s, hd = x.shape
    return x.transpose(1, 2).reshape(b * s, heads, hd)


def _varlen_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runs: DocumentRuns,
    gqa: bool,
    scale: Optional[float],
    window: Optional[int],
) -> torch.Tensor:
    b, n_heads, s, hd = q.shape
    # [b * s, heads, hd]: views of the projections; grouped K/V are copied per query head in this layout, once.
    k, v, gqa_kwargs = _varlen_kv(_as_tokens(k), _as_tokens(v), n_heads, gqa)
    out = varlen_attn(
        _as_tokens(q),
        k,
        v,
        runs.cu_seqlens,
        runs.cu_seqlens,
        runs.max_length,
        runs.max_length,
        scale=scale,
        # (-1, 0): causal; (W - 1, 0): causal within the W tokens ending at the query.
        window_size=(-1, 0) if window is None else (window - 1, 0),
        **gqa_kwargs,
    )  # [b * s, n_heads, hd]
    return out.view(b, s, n_heads, hd)


def _varlen_kv(k: torch.Tensor, v: torch.Tensor, n_heads: int, gqa: bool
               ) -> tuple[torch.Tensor, torch.Tensor, dict[str, bool]]:
    """K/V ``[tokens, n_kv_heads, hd]`` as ``varlen_attn`` takes them, and its grouped-K/V keyword: as they are
    with ``enable_gqa=True`` where this torch has it; on a torch without it (before 2.12), each K/V head copied for
    the query heads that share it (``repeat_interleave``, the grouping SDPA uses). The copies are what
    ``varlen_kv_copy_bytes`` counts for the planner: the kernel saves them for backward, so a block without AC
    keeps them until its backward; still far less than leaving Flash Attention for one call per document."""
    if not gqa:
        return k, v, ({"enable_gqa": False} if VARLEN_SUPPORT.enable_gqa else {})
    if VARLEN_SUPPORT.enable_gqa:
        return k, v, {"enable_gqa": True}
    group = n_heads // k.shape[1]
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), {}  # [tokens, n_heads, hd]


def varlen_kv_copy_bytes(tokens: int, n_heads: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The bytes the varlen path of one attention call over ``tokens`` packed tokens holds beyond grouped K/V, on
    this torch: K and V per query head (``_varlen_kv``) where ``varlen_attn`` has no ``enable_gqa=`` and the model
    groups its K/V heads; 0 where nothing is copied (torch 2.12 or newer, no GQA, a dtype varlen does not take)."""
    if (n_heads == n_kv_heads or dtype not in _VARLEN_DTYPES or not VARLEN_SUPPORT.present
            or VARLEN_SUPPORT.enable_gqa):
        return 0
    return 2 * tokens * (n_heads - n_kv_heads) * head_dim * dtype.itemsize


@torch.compiler.disable
def _per_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    runs: DocumentRuns,
    dropout_p: float,
    gqa: bool,
    scale: Optional[float],
    window: Optional[int],
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One causal ``scaled_dot_product_attention`` call per document (shapes as in ``causal_attention``), or one
    ``_explicit_attention`` with ``softcap`` or ``sinks``."""
    b, n_heads, s, hd = q.shape
    kernel = (_causal_sdpa if softcap is None and sinks is None
              else functools.partial(_explicit_attention, softcap=softcap, sinks=sinks))
    outs = []
    lengths = runs.lengths.tolist()  # on the CPU: no synchronisation
    for q_doc, k_doc, v_doc in zip(*(_as_tokens(x).split(lengths) for x in (q, k, v))):
        # [length, heads, hd] -> [1, heads, length, hd]
        q_doc, k_doc, v_doc = (x.transpose(0, 1).unsqueeze(0) for x in (q_doc, k_doc, v_doc))
        out = kernel(
            q_doc, k_doc, v_doc, dropout_p=dropout_p, gqa=gqa, scale=scale, window=window
        )  # [1, n_heads, length, hd]
        outs.append(out.squeeze(0).transpose(0, 1))  # [length, n_heads, hd]
    return torch.cat(outs).view(b, s, n_heads, hd)
