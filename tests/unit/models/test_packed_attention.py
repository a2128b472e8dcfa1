"""Packed attention: one causal call per document, equal to the dense-mask oracle (``attention_oracle``) within
rounding (``numerics``: the oracle adds over whole rows, the kernels per document), with and without dropout, in
every activation-checkpointing mode, and compiled."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from attention_oracle import DropoutMaskRecorder, dense_attention_oracle, dense_document_attention, document_spans
from numerics import assert_all_close, assert_close, llama_terms
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters
from torch.nn.attention.varlen import varlen_attn
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_ac.data.collate import document_lengths
from torchtune_ac.models import attention, llama
from torchtune_ac.models.attention import causal_attention, document_runs
from torchtune_ac.models.llama import Llama, LlamaArgs
from torchtune_ac.activation_checkpointing.config import setup_activation_checkpointing

VOCAB = 96
FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
VARLEN = torch.ops.torch_attn._varlen_attn.default
AC_SETTINGS = [("none", None), ("full", None), ("selective", 2), ("selective", "op")]


def ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """``[b, s]`` document ids with documents of the given lengths in each row (ids 0, 1, 2, ... per row)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


# Two rows of 24 tokens: documents of several lengths, a single-token document, a repeated id (a new document).
PACKED_IDS = torch.tensor([
    [0] * 5 + [1] * 9 + [2] + [0] * 9,
    [0] * 11 + [1] * 13,
])
# Document layouts of batches [2, 24] that follow one another (compile must not recompile for each).
LAYOUTS = [[[5, 9, 1, 9], [11, 13]], [[24], [3, 21]], [[12, 12], [1, 1, 1, 21]], [[2] * 12, [24]], [[4, 20], [6, 18]]]


def build(n_layers: int = 2, dropout: float = 0.0) -> Llama:
    """A GQA model (4 query heads, 2 KV heads) whose only dropout is attention dropout."""
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, intermediate_dim=64,
                     max_seq_len=64, attn_dropout=dropout)
    model = Llama(args)
    model.init_weights(std=0.2)  # large enough weights that attention patterns are far from uniform
    return model


def tokens_for(ids: torch.Tensor, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, ids.shape, generator=torch.Generator().manual_seed(seed))


def forward_backward(model: Llama, tokens: torch.Tensor, ids, seed: int = 1234):
    """Logits and parameter gradients of one forward + backward under a fixed RNG state."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    logits = model(tokens, ids)
    (logits.square().mean() + logits.logsumexp(-1).mean()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def attention_terms(head_dim: int, seq_len: int) -> int:
    """The additions behind attention's output and its inputs' gradients: the scores (``head_dim``), the softmax
    and the weighted sum (``seq_len`` each), forward and again in backward, and the query heads that share a key
    / value head summed into its gradient (fewer than ``seq_len`` here)."""
    return 2 * (head_dim + 2 * seq_len) + seq_len


def assert_same(actual, expected, *, exact: bool = False) -> None:
    """Logits and gradients of ``forward_backward``: within rounding of a forward and backward of ``build()``'s
    model on a ``[2, 24]`` batch, or, with ``exact``, bit for bit."""
    (logits, grads), (ref_logits, ref_grads) = actual, expected
    if exact:
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
        return
    args = build().args
    assert_close(logits, ref_logits, terms=llama_terms(args, 24, 0, backward=False), what="logits")
    assert_all_close(grads, ref_grads, terms=llama_terms(args, 24, 2 * 24), what="gradient")


@pytest.mark.parametrize(
    "ids, lengths",
    [
        ([[0, 0, 0, 1, 1, 2]], (3, 2, 1)),
        ([[0, 0, 1, 1, 0, 0]], (2, 2, 2)),  # a repeated id starts a document of its own
        ([[0, 0, 0], [0, 1, 1]], (3, 1, 2)),  # every row starts a document, whatever its first id
        ([[7, 7], [7, 7]], (2, 2)),
        ([[0, 1, 2, 3]], (1, 1, 1, 1)),
    ],
)
def test_document_runs_are_the_contiguous_runs_row_after_row(ids, lengths):
    runs = document_runs(torch.tensor(ids))
    assert tuple(runs.lengths.tolist()) == lengths and runs.lengths.device.type == "cpu"
    assert runs.cu_seqlens.dtype == torch.int32
    assert runs.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert runs.max_length == max(lengths)
    assert runs.varlen_device is False  # CPU
    assert [end - start for _, start, end in document_spans(torch.tensor(ids))] == list(lengths)
    # The collate code's count, on the host, gives the same runs without reading the ids back from the device.
    counted = document_lengths(torch.tensor(ids))
    from_host = document_runs(torch.tensor(ids), counted)
    assert tuple(from_host.lengths.tolist()) == lengths and from_host.max_length == runs.max_length
    assert from_host.cu_seqlens.dtype == torch.int32 and torch.equal(from_host.cu_seqlens, runs.cu_seqlens)


def test_host_document_lengths_must_cover_the_batch():
    with pytest.raises(ValueError, match="add up to 5 tokens, the batch has 6"):
        document_runs(torch.tensor([[0, 0, 0, 1, 1, 2]]), torch.tensor([3, 2]))


# (n_heads, n_kv_heads, document lengths per row)
ATTENTION_CASES = {
    "gqa": (4, 2, [[5, 9, 1, 9], [11, 13]]),
    "mha": (4, 4, [[12, 12], [1, 1, 22]]),
    "mqa": (4, 1, [[3, 21], [24]]),
    "one_document_per_row": (4, 2, [[24], [24]]),
    "single_tokens": (2, 1, [[1] * 8]),
}


@pytest.mark.numerics
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_packed_attention_equals_the_dense_oracle(case):
    n_heads, n_kv_heads, lengths = ATTENTION_CASES[case]
    ids = ids_from_lengths(lengths)
    b, s = ids.shape
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, 8, generator=generator) * 2 for heads in (n_heads, n_kv_heads, n_kv_heads))
    grad_out = torch.randn(b, s, n_heads, 8, generator=generator)

    def run(fn):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*inputs)
        out.backward(grad_out)
        return out.detach(), [x.grad for x in inputs]

    out, grads = run(lambda q, k, v: causal_attention(q, k, v, dropout_p=0.0, runs=document_runs(ids)))
    ref_out, ref_grads = run(lambda q, k, v: dense_document_attention(q, k, v, ids))
    terms = attention_terms(8, s)
    assert_close(out, ref_out, terms=terms, what="output")
    # The three gradients add products of the same tensors; a document of one token cancels q's to zero.
    magnitude = max(float(g.abs().max()) for g in ref_grads)
    for grad, ref_grad, name in zip(grads, ref_grads, "qkv"):
        assert_close(grad, ref_grad, terms=terms, magnitude=magnitude, what=f"{name}'s gradient")


class AttentionCalls(TorchDispatchMode):
    """Records the attention kernels run (with their query / key shapes) and the largest tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (FLASH_CPU, FLASH_CPU_BACKWARD):
            q, k = (args[0], args[1]) if func is FLASH_CPU else (args[1], args[2])
            self.calls.append((func.__name__, tuple(q.shape), tuple(k.shape)))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_only_pairs_within_documents_are_computed_with_grouped_kv_as_they_are():
    """No query-key pair across documents, no ``[b, s, s]`` mask or score tensor, no K/V copy."""
    lengths = [[10, 20, 2, 32], [64]]
    ids = ids_from_lengths(lengths)
    b, s, n_heads, n_kv_heads, hd = 2, 64, 4, 2, 4
    q = torch.randn(b, n_heads, s, hd, requires_grad=True)
    k, v = (torch.randn(b, n_kv_heads, s, hd, requires_grad=True) for _ in range(2))
    runs = document_runs(ids)
    with AttentionCalls() as recorder:
        causal_attention(q, k, v, dropout_p=0.0, runs=runs).sum().backward()
    doc_lengths = [n for row in lengths for n in row]
    expected = [(1, n_heads, n, hd) for n in doc_lengths]
    assert [call[1] for call in recorder.calls if call[0] == FLASH_CPU.__name__] == expected
    assert [call[1] for call in recorder.calls if call[0] == FLASH_CPU_BACKWARD.__name__] == expected[::-1]
    assert all(call[2][1] == n_kv_heads for call in recorder.calls)  # K reaches the kernel un-expanded
    # Every tensor is smaller than a [b, s, s] mask would be (q, k, v and the output are b * s * heads * hd).
    assert recorder.largest < b * s * s
    assert recorder.largest == b * s * n_heads * hd


def test_an_unpacked_batch_is_one_causal_call_per_layer():
    model = build(n_layers=3)
    tokens = tokens_for(torch.zeros(2, 24))
    with AttentionCalls() as recorder:
        model(tokens)
    assert [call[1] for call in recorder.calls] == [(2, 4, 24, 8)] * 3


@pytest.mark.numerics
@pytest.mark.parametrize("mode, option", AC_SETTINGS)
def test_model_logits_and_gradients_equal_the_dense_oracle_in_every_ac_mode(mode, option):
    tokens = tokens_for(PACKED_IDS)
    with dense_attention_oracle(PACKED_IDS):
        expected = forward_backward(build(), tokens, PACKED_IDS)
    model = build()
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    assert_same(forward_backward(model, tokens, PACKED_IDS), expected)
    # The oracle is not trivially satisfied: without document ids the documents see each other.
    leaking = forward_backward(build(), tokens, None)
    assert (leaking[0] - expected[0]).abs().max() > 1e-2


@pytest.mark.numerics
def test_with_dropout_equal_to_the_dense_oracle_drawing_the_same_masks():
    """The per-document path draws one dropout mask per document; the dense oracle, handed those masks
    (zero across documents), gives the same logits and gradients. Other masks give other results."""
    tokens = tokens_for(PACKED_IDS)
    p = 0.3
    model = build(dropout=p)
    with DropoutMaskRecorder() as recorder:
        actual = forward_backward(model, tokens, PACKED_IDS)
    n_documents = len(document_spans(PACKED_IDS))
    assert len(recorder.masks) == model.args.n_layers * n_documents
    with dense_attention_oracle(PACKED_IDS, recorder.masks, p):
        expected = forward_backward(build(dropout=p), tokens, PACKED_IDS)
    assert_same(actual, expected)
    with DropoutMaskRecorder() as other:
        forward_backward(build(dropout=p), tokens, PACKED_IDS, seed=99)
    with dense_attention_oracle(PACKED_IDS, other.masks, p):
        other_masks = forward_backward(build(dropout=p), tokens, PACKED_IDS)
    assert (other_masks[0] - actual[0]).abs().max() > 1e-2


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no_dropout", "dropout"])
def test_per_op_ac_keeps_the_attention_outputs_of_packed_batches(dropout):
    """Per-op AC recomputes no attention kernel with document ids: it runs the same attention kernels as no AC
    (flash per document; with dropout, the math path's two batched matmuls per document), full AC runs the
    forward ones twice."""
    ids, tokens = PACKED_IDS, tokens_for(PACKED_IDS)
    attention_ops = {FLASH_CPU, torch.ops.aten.bmm.default}

    class CountAttentionOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func in attention_ops
            return func(*args, **(kwargs or {}))

    counts = {}
    for mode, option in [("none", None), ("selective", "op"), ("full", None)]:
        model = build(dropout=dropout)
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        torch.manual_seed(0)
        logits = model(tokens, ids)
        with CountAttentionOps() as counter:
            logits.sum().backward()
        counts[mode] = counter.count
    n_documents = len(document_spans(ids))
    # In backward: no AC and per-op AC run only backward kernels (flash: none of attention_ops; math: 4 bmm per
    # document), full AC recomputes each document's forward attention first.
    backward_only = 0 if dropout == 0.0 else 4 * n_documents * 2
    recompute = n_documents * 2 * (1 if dropout == 0.0 else 2)
    assert counts == {"none": backward_only, "selective": backward_only, "full": backward_only + recompute}


# ---- the CUDA path: torch's varlen_attn, run here through CPU kernels for its ops --------------------------


def _reference_documents(q, k, v, cu_seqlens, scale, window_size):
    """Per-document causal attention in float32 over ``[T, heads, hd]`` tensors, within ``window_size``'s left
    extent when it is not -1: output ``[T, h, hd]``, the probabilities and (repeated) K/V of each document, for
    the reference backward."""
    outs, saved = [], []
    offsets = cu_seqlens.tolist()
    for start, end in zip(offsets[:-1], offsets[1:]):
        qd, kd, vd = (x[start:end].transpose(0, 1).float() for x in (q, k, v))  # [heads, L, hd]
        repeat = qd.shape[0] // kd.shape[0]
        kd, vd = kd.repeat_interleave(repeat, dim=0), vd.repeat_interleave(repeat, dim=0)
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        if window_size[0] != -1:
            causal = causal.triu(-window_size[0])
        probs = (qd @ kd.transpose(1, 2) * scale).masked_fill(~causal, float("-inf")).softmax(-1)  # [h, L, L]
        outs.append((probs @ vd).transpose(0, 1))
        saved.append((qd, kd, vd, probs, repeat))
    return torch.cat(outs), saved


def varlen_forward_on_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                          window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """``torch_attn::_varlen_attn`` as documented, in plain tensor maths (no logsumexp: the backward below
    recomputes the probabilities)."""
    # Causal: is_causal, or a window whose right extent is 0 (Flash Attention masks the future then).
    assert window_size[1] == 0 and is_causal == (window_size[0] == -1)
    assert torch.equal(cu_seq_q, cu_seq_k) and seqused_k is None and block_table is None
    lengths = cu_seq_q.diff()
    assert max_q == max_k == int(lengths.max()) and (enable_gqa or key.shape[1] == query.shape[1])
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    out, _ = _reference_documents(query, key, value, cu_seq_q, scale, window_size)
    lse = torch.zeros(query.shape[1], query.shape[0])
    return out.to(query.dtype), lse, torch.zeros(2, dtype=torch.uint64)


def varlen_backward_on_cpu(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
                           rng_state, scale=None, window_size=None):
    """``torch_attn::_varlen_attn_backward``: softmax attention's gradients, written out (autograd does not
    record inside an operator's kernel)."""
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    _, saved = _reference_documents(query, key, value, cu_seq_q, scale, window_size)
    grads = {"q": [], "k": [], "v": []}
    offsets = cu_seq_q.tolist()
    for (start, end), (qd, kd, vd, probs, repeat) in zip(zip(offsets[:-1], offsets[1:]), saved):
        d_out = grad_out[start:end].transpose(0, 1).float()  # [h, L, hd]
        d_v = probs.transpose(1, 2) @ d_out
        d_probs = d_out @ vd.transpose(1, 2)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdim=True)) * scale
        d_q, d_k = d_scores @ kd, d_scores.transpose(1, 2) @ qd
        heads_kv = kd.shape[0] // repeat
        for name, grad in (("q", d_q), ("k", d_k.view(heads_kv, repeat, *d_k.shape[1:]).sum(1)),
                           ("v", d_v.view(heads_kv, repeat, *d_v.shape[1:]).sum(1))):
            grads[name].append(grad.transpose(0, 1))
    return tuple(torch.cat(grads[n]).to(x.dtype) for n, x in (("q", query), ("k", key), ("v", value)))


@pytest.fixture(scope="module")
def varlen_on_cpu():
    """The CUDA path cannot run here (Flash Attention needs a GPU). With CPU kernels for torch's own varlen ops,
    registered through the public ``torch.library.register_kernel`` for this test process (nothing else calls
    those ops on CPU), it runs from ``varlen_attn``'s public function through its own autograd."""
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", varlen_forward_on_cpu)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", varlen_backward_on_cpu)


def with_varlen_device(monkeypatch, fp32: bool = True) -> None:
    """Make ``Llama.forward`` treat the batch as if it were on a GPU that runs ``varlen_attn``; with ``fp32``,
    let fp32 take that path too (Flash Attention itself takes fp16/bf16 only), so that the model's results can
    be compared with the oracle to fp32 precision."""
    monkeypatch.setattr(llama, "document_runs", lambda ids, lengths=None: dataclasses.replace(
        document_runs(ids, lengths), varlen_device=True))
    if fp32:
        monkeypatch.setattr(attention, "_VARLEN_DTYPES", (torch.float32,))


@pytest.mark.numerics
def test_the_cpu_varlen_kernels_are_the_dense_oracle(varlen_on_cpu):
    ids = ids_from_lengths(ATTENTION_CASES["gqa"][2])
    b, s = ids.shape
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b * s, heads, 8, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    grad_out = torch.randn(b * s, 4, 8, generator=generator)
    runs = document_runs(ids)
    out = varlen_attn(q, k, v, runs.cu_seqlens, runs.cu_seqlens, runs.max_length, runs.max_length,
                      window_size=(-1, 0), enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    as_heads = [x.detach().view(b, s, *x.shape[1:]).transpose(1, 2).requires_grad_() for x in (q, k, v)]
    expected = dense_document_attention(*as_heads, ids)  # [b, s, h, hd]
    expected_grads = torch.autograd.grad(expected, as_heads, grad_out.view(b, s, 4, 8))
    terms = attention_terms(8, s)
    assert_close(out.view(b, s, 4, 8), expected, terms=terms, what="output")
    for grad, ref, name in zip(grads, expected_grads, "qkv"):
        assert_close(grad.view(b, s, *grad.shape[1:]), ref.transpose(1, 2), terms=terms, what=f"{name}'s gradient")


class CountOps(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


@pytest.mark.numerics
def test_varlen_path_of_the_model_equals_the_dense_oracle(varlen_on_cpu, monkeypatch):
    tokens = tokens_for(PACKED_IDS)
    with dense_attention_oracle(PACKED_IDS):
        expected = forward_backward(build(), tokens, PACKED_IDS)
    with_varlen_device(monkeypatch)
    model = build()
    with CountOps({VARLEN}) as counter:
        actual = forward_backward(model, tokens, PACKED_IDS)
    assert counter.count == model.args.n_layers  # one call per layer, over all documents of the batch
    assert_same(actual, expected)


def test_varlen_is_taken_in_half_precision_without_dropout_only(varlen_on_cpu, monkeypatch):
    """Flash Attention has no dropout and no fp32: those take the per-document path."""
    with_varlen_device(monkeypatch, fp32=False)
    tokens = tokens_for(PACKED_IDS)
    calls = {}
    for name, model in [("bf16", build().bfloat16()), ("fp16", build().half()),
                        ("bf16_dropout", build(dropout=0.1).bfloat16()), ("fp32", build())]:
        with CountOps({VARLEN}) as counter:
            model(tokens, PACKED_IDS)
        calls[name] = counter.count
    assert calls == {"bf16": 2, "fp16": 2, "bf16_dropout": 0, "fp32": 0}


def test_per_op_ac_keeps_the_varlen_output(varlen_on_cpu, monkeypatch):
    with_varlen_device(monkeypatch)
    tokens = tokens_for(PACKED_IDS)
    recomputed = {}
    for mode, option in [("selective", "op"), ("full", None)]:
        model = build()
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        logits = model(tokens, PACKED_IDS)
        with CountOps({VARLEN}) as counter:
            logits.sum().backward()
        recomputed[mode] = counter.count
    assert recomputed == {"selective": 0, "full": 2}


@pytest.mark.parametrize("mode, option", [("selective", "op"), ("full", None)])
def test_varlen_path_compiles_into_the_checkpointed_block_once(varlen_on_cpu, monkeypatch, mode, option):
    """Compiled, the varlen path is traced whole (no graph break, even inside a checkpoint) and is recompiled at
    most once as document layouts change (its offsets and longest length then become dynamic)."""
    with_varlen_device(monkeypatch)
    eager, model = build(), build()
    for m in (eager, model):
        setup_activation_checkpointing(m, ac_mode=mode, ac_option=option)
    counts = {"graphs": 0}
    aot_eager = lookup_backend("aot_eager")  # AOTAutograd and its partitioner, as inductor uses them

    def counting_backend(graph_module, example_inputs):
        counts["graphs"] += 1
        return aot_eager(graph_module, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    for block in model.layers:
        block.compile(backend=counting_backend)
    graphs = []
    for lengths in LAYOUTS:
        ids = ids_from_lengths(lengths)
        tokens = tokens_for(ids)
        # Bit for bit: aot_eager runs the traced ATen ops one by one, the kernels eager runs, in its order.
        assert_same(forward_backward(model, tokens, ids), forward_backward(eager, tokens, ids), exact=True)
        graphs.append(counts["graphs"])
    assert not counters["graph_break"]
    # Both blocks share one graph; one recompile makes the offsets and the longest length dynamic.
    assert graphs[0] == 1 and graphs[-1] <= 2, graphs
    torch._dynamo.reset()


def compile_blocks_counting_graphs(model: Llama) -> dict:
    """``block.compile()`` (inductor) on every block; the returned dict counts the graphs compiled."""
    from torch._inductor.compile_fx import compile_fx

    counts = {"graphs": 0}

    def counting_inductor(graph_module, example_inputs):
        counts["graphs"] += 1
        return compile_fx(graph_module, example_inputs)

    torch._dynamo.reset()
    for block in model.layers:
        block.compile(backend=counting_inductor)
    return counts


@pytest.mark.parametrize("mode, option", [("none", None), ("selective", "op")])
def test_compiled_blocks_on_packed_batches_match_eager_and_compile_once(mode, option):
    """``compile: true`` on CPU: the per-document loop runs eagerly (``torch.compiler.disable``), so its
    changing trip count and sizes never reach a guard. Without AC each block compiles into two graphs, before and
    after the attention; a checkpointed block cannot be split inside its checkpoint, so Dynamo runs it eagerly
    on packed batches (unpacked batches stay compiled). Either way nothing is recompiled when the layout
    changes, and the results are eager's, attention dropout included (its masks are drawn eagerly)."""
    eager, model = build(dropout=0.2), build(dropout=0.2)
    for m in (eager, model):
        setup_activation_checkpointing(m, ac_mode=mode, ac_option=option)
    counts = compile_blocks_counting_graphs(model)
    graphs = []
    for lengths in LAYOUTS:
        ids = ids_from_lengths(lengths)
        tokens = tokens_for(ids)
        assert_same(forward_backward(model, tokens, ids), forward_backward(eager, tokens, ids))
        graphs.append(counts["graphs"])
    assert graphs == [4 if mode == "none" else 0] * len(LAYOUTS)
    torch._dynamo.reset()


# ---- sliding-window attention: the same paths with a window, against the dense oracle's band ---------------

WINDOW = 6


def build_sliding(n_layers: int = 2, dropout: float = 0.0) -> Llama:
    """``build()`` with a window of ``WINDOW`` tokens in layer 0 (with a RoPE base of its own) and full
    attention in layer 1: documents of ``PACKED_IDS`` are both longer and shorter than the window."""
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2, intermediate_dim=64,
                     max_seq_len=64, attn_dropout=dropout, sliding_window=WINDOW, sliding_rope_theta=100.0,
                     layer_types=("sliding_attention", "full_attention") * (n_layers // 2))
    model = Llama(args)
    model.init_weights(std=0.2)
    return model


@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one_sequence_per_row"])
def test_sliding_window_attention_equals_the_dense_oracle(case, packed):
    n_heads, n_kv_heads, lengths = ATTENTION_CASES[case]
    ids = ids_from_lengths(lengths) if packed else torch.zeros(2, sum(lengths[0]), dtype=torch.long)
    b, s = ids.shape
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, 8, generator=generator) * 2 for heads in (n_heads, n_kv_heads, n_kv_heads))
    grad_out = torch.randn(b, s, n_heads, 8, generator=generator)
    runs = document_runs(ids) if packed else None

    def run(fn):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*inputs)
        out.backward(grad_out)
        return out.detach(), [x.grad for x in inputs]

    out, grads = run(lambda q, k, v: causal_attention(q, k, v, dropout_p=0.0, runs=runs, window=WINDOW))
    ref_out, ref_grads = run(lambda q, k, v: dense_document_attention(q, k, v, ids, window=WINDOW))
    terms = attention_terms(8, s)
    assert_close(out, ref_out, terms=terms, what="output")
    magnitude = max(float(g.abs().max()) for g in ref_grads)
    for grad, ref_grad, name in zip(grads, ref_grads, "qkv"):
        assert_close(grad, ref_grad, terms=terms, magnitude=magnitude, what=f"{name}'s gradient")
    if max(max(row) for row in lengths) > WINDOW or not packed:  # the window matters here
        assert (out - dense_document_attention(q, k, v, ids)).abs().max() > 1e-2


@pytest.mark.parametrize("mode, option", AC_SETTINGS)
def test_sliding_window_model_equals_the_dense_oracle_in_every_ac_mode(mode, option):
    """Packed rows whose documents are longer than the window; every AC mode gives no AC's gradients bit for
    bit (the same ops, replayed)."""
    tokens = tokens_for(PACKED_IDS)
    with dense_attention_oracle(PACKED_IDS):
        expected = forward_backward(build_sliding(), tokens, PACKED_IDS)
    no_ac = forward_backward(build_sliding(), tokens, PACKED_IDS)
    model = build_sliding()
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    actual = forward_backward(model, tokens, PACKED_IDS)
    assert_same(actual, expected)
    assert_same(actual, no_ac, exact=True)  # AC replays the same ops in the same order
    # The window and the sliding layers' own RoPE both matter: full attention everywhere computes otherwise.
    full = build()
    full.load_state_dict(build_sliding().state_dict())
    assert (forward_backward(full, tokens, PACKED_IDS)[0] - expected[0]).abs().max() > 1e-2


def test_sliding_window_with_dropout_equals_the_dense_oracle_drawing_the_same_masks():
    tokens, p = tokens_for(PACKED_IDS), 0.3
    with DropoutMaskRecorder() as recorder:
        actual = forward_backward(build_sliding(dropout=p), tokens, PACKED_IDS)
    with dense_attention_oracle(PACKED_IDS, recorder.masks, p):
        expected = forward_backward(build_sliding(dropout=p), tokens, PACKED_IDS)
    assert_same(actual, expected)


def test_the_varlen_path_takes_the_window_and_equals_the_dense_oracle(varlen_on_cpu, monkeypatch):
    tokens = tokens_for(PACKED_IDS)
    with dense_attention_oracle(PACKED_IDS):
        expected = forward_backward(build_sliding(), tokens, PACKED_IDS)
    with_varlen_device(monkeypatch)
    windows = []

    def recording_varlen(*args, **kwargs):
        windows.append(kwargs["window_size"])
        return varlen_attn(*args, **kwargs)

    monkeypatch.setattr(attention, "varlen_attn", recording_varlen)
    assert_same(forward_backward(build_sliding(), tokens, PACKED_IDS), expected)
    assert windows == [(WINDOW - 1, 0), (-1, 0)]  # layer 0 slides, layer 1 is full


def test_compiled_sliding_window_blocks_match_eager():
    """Compiled with per-op AC, on packed rows (run eagerly, as every checkpointed block on packed rows) and on
    unpacked rows longer than the window (the band mask and the policy traced into the graph): eager's results,
    with no recompile as layouts change."""
    eager, model = build_sliding(), build_sliding()
    for m in (eager, model):
        setup_activation_checkpointing(m, ac_mode="selective", ac_option="op")
    counts = compile_blocks_counting_graphs(model)
    graphs = []
    for lengths in LAYOUTS[:3]:
        ids = ids_from_lengths(lengths)
        tokens = tokens_for(ids)
        assert_same(forward_backward(model, tokens, ids), forward_backward(eager, tokens, ids))
        graphs.append(counts["graphs"])
    tokens = tokens_for(PACKED_IDS)
    assert_same(forward_backward(model, tokens, None), forward_backward(eager, tokens, None))
    assert graphs == [graphs[0]] * len(graphs)
    torch._dynamo.reset()


# ---- torch versions whose varlen_attn lacks what the call needs: detected, and the per-document path instead ----


def varlen_of_torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None,
                         scale=None):
    """``varlen_attn``'s signature before sliding windows (``is_causal=``, no ``window_size=``)."""
    raise AssertionError("a signature, never called")


def varlen_of_torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1)):
    """``varlen_attn``'s signature with sliding windows but without ``enable_gqa=``."""
    raise AssertionError("a signature, never called")


@pytest.mark.parametrize("function, support, lacks_for_gqa", [
    (None, attention.VarlenSupport(False, False, False), ("torch.nn.attention.varlen",)),
    (varlen_of_torch_2_10, attention.VarlenSupport(True, False, False), ("varlen_attn(window_size=)",)),
    (varlen_of_torch_2_11, attention.VarlenSupport(True, True, False), ()),
    (varlen_attn, attention.VarlenSupport(True, True, True), ()),
])
def test_what_varlen_attn_can_do_is_read_from_its_signature(function, support, lacks_for_gqa):
    assert attention.detect_varlen_support(function) == support
    assert support.lacks(gqa=True) == support.lacks(gqa=False) == lacks_for_gqa  # grouped K/V: copied if need be


@pytest.fixture
def fresh_announcements():
    attention._announce_per_document_fallback.__wrapped__.cache_clear()
    yield
    attention._announce_per_document_fallback.__wrapped__.cache_clear()


@pytest.mark.parametrize("function", [None, varlen_of_torch_2_10])
def test_a_torch_without_what_varlen_needs_takes_the_per_document_path_with_the_same_result(
        varlen_on_cpu, monkeypatch, caplog, fresh_announcements, function):
    """On a GPU batch (simulated: ``with_varlen_device``, torch's varlen ops given CPU kernels), the path follows
    the detected support: with all of ``varlen_attn`` one varlen call per layer; on a torch that lacks it (the
    support detected from an older signature, or from none) no varlen call, the per-document path, the same
    logits and gradients within rounding (the two add in other orders), and one warning over several steps.
    Flash Attention itself (the real kernels) needs a GPU: there the same choice is made by the same detection."""
    with_varlen_device(monkeypatch)
    tokens = tokens_for(PACKED_IDS)
    with CountOps({VARLEN}) as counter:
        expected = forward_backward(build(), tokens, PACKED_IDS)
    assert counter.count == 2
    monkeypatch.setattr(attention, "VARLEN_SUPPORT", attention.detect_varlen_support(function))
    model = build()
    with caplog.at_level("WARNING", logger=attention.__name__), CountOps({VARLEN}) as counter:
        actual = forward_backward(model, tokens, PACKED_IDS)
        forward_backward(model, tokens, PACKED_IDS)
    assert counter.count == 0
    assert_same(actual, expected)
    warnings = [r.getMessage() for r in caplog.records if r.name == attention.__name__]
    assert len(warnings) == 1 and "one attention call per document" in warnings[0]


def test_without_enable_gqa_grouped_kv_are_copied_per_head_and_still_take_varlen(varlen_on_cpu, monkeypatch,
                                                                              caplog, fresh_announcements):
    """torch 2.11's ``varlen_attn`` has ``window_size=`` but no ``enable_gqa=``: a grouped-query model (Llama 3,
    Qwen, Mistral) still makes one varlen call per layer, with K/V copied per query head, and no call is given
    ``enable_gqa``; its logits and gradients are those of the grouped call within rounding (the same products,
    the copies' gradients summed back per K/V head), and nothing is announced."""
    with_varlen_device(monkeypatch)
    tokens = tokens_for(PACKED_IDS)
    expected = forward_backward(build(), tokens, PACKED_IDS)
    monkeypatch.setattr(attention, "VARLEN_SUPPORT", attention.detect_varlen_support(varlen_of_torch_2_11))
    seen = []
    real = attention.varlen_attn
    monkeypatch.setattr(attention, "varlen_attn", lambda *a, **k: seen.append((a[1].shape, sorted(k))) or real(*a, **k))
    model = build()
    with caplog.at_level("WARNING", logger=attention.__name__), CountOps({VARLEN}) as counter:
        actual = forward_backward(model, tokens, PACKED_IDS)
    assert counter.count == model.args.n_layers  # one call per layer
    assert {shape[1] for shape, _ in seen} == {model.args.n_heads}  # K as many heads as Q
    assert all("enable_gqa" not in keys for _, keys in seen)
    assert_same(actual, expected)
    assert not [r for r in caplog.records if r.name == attention.__name__]


HIDE_VARLEN = """
import importlib.abc, sys

class HideVarlen(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch.nn.attention.varlen":
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, HideVarlen())
"""


def test_the_package_imports_and_trains_on_a_torch_without_torch_nn_attention_varlen(tmp_path):
    """A torch older than 2.9 has no ``torch.nn.attention.varlen``: hidden from a fresh interpreter, the package
    still imports, per-op AC keeps every other op, and a packed forward and backward of a GQA model under it
    gives the logits and gradients of this process bit for bit (the same CPU kernels in the same order: the
    varlen path is never taken on a CPU)."""
    script = tmp_path / "run.py"
    script.write_text(HIDE_VARLEN + f"""
import torch
from torchtune_ac.models import attention
from torchtune_ac.models.llama import Llama, LlamaArgs
from torchtune_ac.activation_checkpointing.config import setup_activation_checkpointing
from torchtune_ac.activation_checkpointing.mechanism import SAVED_OPS

assert "torch.nn.attention.varlen" not in sys.modules
torch.manual_seed(0)
model = Llama(LlamaArgs(vocab_size={VOCAB}, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64,
                        max_seq_len=64))
model.init_weights(std=0.2)
setup_activation_checkpointing(model, ac_mode="selective", ac_option="op")
ids = torch.tensor({PACKED_IDS.tolist()})
tokens = torch.randint(0, {VOCAB}, ids.shape, generator=torch.Generator().manual_seed(1))
logits = model(tokens, ids)
logits.square().mean().backward()
torch.save({{"support": attention.VARLEN_SUPPORT, "saved_ops": len(SAVED_OPS), "logits": logits.detach(),
            "grads": {{n: p.grad for n, p in model.named_parameters()}}}}, {str(tmp_path / "out.pt")!r})
""")
    root = Path(attention.__file__).resolve().parents[2]
    subprocess.run([sys.executable, str(script)], check=True, cwd=tmp_path,
                   env={**os.environ, "PYTHONPATH": str(root)})
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["support"] == attention.VarlenSupport(False, False, False)
    # The aten matmuls (the grouped one too) and SDPA kernels, and the collectives (the all-to-all too): no varlen op.
    assert out["saved_ops"] == 9 + 5
    torch.manual_seed(0)
    model = Llama(LlamaArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64,
                            max_seq_len=64))
    model.init_weights(std=0.2)
    setup_activation_checkpointing(model, ac_mode="selective", ac_option="op")
    logits = model(tokens_for(PACKED_IDS), PACKED_IDS)
    logits.square().mean().backward()
    torch.testing.assert_close(out["logits"], logits.detach(), rtol=0, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(out["grads"][name], p.grad, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.cuda
def test_on_a_gpu_flash_varlen_and_the_per_document_fallback_agree(monkeypatch, fresh_announcements):
    """The real kernels (CUDA only; skipped here): one layer's packed attention in bf16 through ``varlen_attn``
    (Flash Attention) and through the per-document SDPA path that a torch lacking it takes, from the same bf16
    inputs. Both accumulate in fp32 and round the output to bf16, so they differ by bf16 rounding. Full heads
    (no GQA) so that torch 2.11, whose ``varlen_attn`` has no ``enable_gqa=``, takes the varlen path too."""
    if attention.VARLEN_SUPPORT.lacks(gqa=False):
        pytest.skip(f"this torch lacks {attention.VARLEN_SUPPORT.lacks(gqa=False)}")
    device = torch.device("cuda")
    ids = PACKED_IDS.to(device)
    b, s = ids.shape
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(b, 4, s, 64, generator=generator, device=device, dtype=torch.bfloat16) for _ in "qkv")
    runs = document_runs(ids)
    assert runs.varlen_device
    with CountOps({VARLEN}) as counter:
        flash = causal_attention(q, k, v, dropout_p=0.0, runs=runs)
    assert counter.count == 1
    monkeypatch.setattr(attention, "VARLEN_SUPPORT", attention.detect_varlen_support(None))
    with CountOps({VARLEN}) as counter:
        per_document = causal_attention(q, k, v, dropout_p=0.0, runs=runs)
    assert counter.count == 0
    assert_close(per_document.float(), flash.float(), terms=attention_terms(64, s), dtype=torch.bfloat16)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_a_block_at_some_rows_is_the_whole_block_at_those_rows(packed, qk_norm):
    # ``rows``: the block's output at those rows of the flattened batch only (the last block before a loss over the
    # targets), each row attending to its own document (or batch row) up to itself; as the whole block's, within
    # rounding (one masked call over all keys against one causal call per document), its gradients too.
    torch.manual_seed(0)
    args = dataclasses.replace(build().args, qk_norm=qk_norm)
    block = llama.TransformerBlock(args)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(2, 24, args.dim)
    cos, sin = Llama(args).rope_cos_sin(torch.arange(24).expand(2, 24), x.dtype)
    runs = document_runs(PACKED_IDS) if packed else None
    rows = torch.tensor([0, 3, 4, 5, 13, 14, 20, 23, 24, 30, 35, 36, 47])
    weights = torch.randn(len(rows), args.dim)

    def run(select):
        block.zero_grad()
        out = select()
        (out * weights).sum().backward()
        return out.detach(), {name: p.grad.clone() for name, p in block.named_parameters()}

    out, grads = run(lambda: block(x, cos, sin, runs, rows=rows))
    expected, expected_grads = run(lambda: block(x, cos, sin, runs).flatten(0, 1).index_select(0, rows))
    terms = llama_terms(dataclasses.replace(args, n_layers=1), 24, len(rows))
    assert_close(out, expected, terms=terms, what="block output")
    assert_all_close(grads, expected_grads, terms=terms, what="gradient")
