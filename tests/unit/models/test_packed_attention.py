"""Packed attention: one causal call per document, exact against the dense-mask oracle (``attention_oracle``),
with and without dropout, in every activation-checkpointing mode, and compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from attention_oracle import DropoutMaskRecorder, dense_attention_oracle, dense_document_attention, document_spans
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_ac.models import attention
from torchtune_ac.models.attention import causal_attention, document_runs
from torchtune_ac.models.llama import Llama, LlamaArgs
from torchtune_ac.training.activation_checkpointing import setup_activation_checkpointing

VOCAB = 96
TOL = {"rtol": 1e-5, "atol": 1e-5}
FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
AC_SETTINGS = [("none", None), ("full", None), ("selective", 2), ("selective", "op")]


def ids_from_lengths(rows: list[list[int]]) -> torch.Tensor:
    """``[b, s]`` document ids with documents of the given lengths in each row (ids 0, 1, 2, ... per row)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


# Two rows of 24 tokens: documents of several lengths, a single-token document, a repeated id (a new document).
PACKED_IDS = torch.tensor([
    [0] * 5 + [1] * 9 + [2] + [0] * 9,
    [0] * 11 + [1] * 13,
])


def build(n_layers: int = 2, dropout: float = 0.0, resid_dropout: float = 0.0, n_kv_heads: int = 2) -> Llama:
    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=VOCAB, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=n_kv_heads,
                     intermediate_dim=64, max_seq_len=64, attn_dropout=dropout, resid_dropout=resid_dropout)
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


def assert_same(actual, expected, **tolerance) -> None:
    (logits, grads), (ref_logits, ref_grads) = actual, expected
    torch.testing.assert_close(logits, ref_logits, **tolerance)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **tolerance, msg=lambda m: f"{name}: {m}")


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
    assert runs.lengths == lengths
    assert runs.cu_seqlens.dtype == torch.int32
    assert runs.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert runs.max_length == max(lengths)
    assert runs.varlen_device is False  # CPU
    assert [end - start for _, start, end in document_spans(torch.tensor(ids))] == list(lengths)


# (n_heads, n_kv_heads, document lengths per row)
ATTENTION_CASES = {
    "gqa": (4, 2, [[5, 9, 1, 9], [11, 13]]),
    "mha": (4, 4, [[12, 12], [1, 1, 22]]),
    "mqa": (4, 1, [[3, 21], [24]]),
    "one_document_per_row": (4, 2, [[24], [24]]),
    "single_tokens": (2, 1, [[1] * 8]),
}


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
    torch.testing.assert_close(out, ref_out, **TOL)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, **TOL)


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


@pytest.mark.parametrize("mode, option", AC_SETTINGS)
def test_model_logits_and_gradients_equal_the_dense_oracle_in_every_ac_mode(mode, option):
    tokens = tokens_for(PACKED_IDS)
    with dense_attention_oracle(PACKED_IDS):
        expected = forward_backward(build(), tokens, PACKED_IDS)
    model = build()
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    assert_same(forward_backward(model, tokens, PACKED_IDS), expected, **TOL)
    # The oracle is not trivially satisfied: without document ids the documents see each other.
    leaking = forward_backward(build(), tokens, None)
    assert (leaking[0] - expected[0]).abs().max() > 1e-2


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
    assert_same(actual, expected, **TOL)
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


def test_varlen_path_hands_flash_attention_the_documented_arguments(monkeypatch):
    """The CUDA path (``varlen_attn``, Flash Attention: fp16/bf16, no dropout) cannot run here. A CPU stand-in
    that follows ``varlen_attn``'s documented contract checks what it is given and what is done with its result."""
    ids = ids_from_lengths([[5, 9, 1, 9], [11, 13]])
    b, s = ids.shape
    runs = dataclasses.replace(document_runs(ids), varlen_device=True)
    calls = []

    def varlen_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size, enable_gqa):
        calls.append((query.shape, key.shape, cu_seq_q.dtype, cu_seq_q.tolist(), cu_seq_k.tolist(), max_q, max_k,
                      window_size, enable_gqa))
        out = []
        for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
            doc = [x[start:end].transpose(0, 1).unsqueeze(0).float() for x in (query, key, value)]  # [1, h, L, hd]
            one_document = torch.zeros(1, end - start, dtype=torch.long)
            out.append(dense_document_attention(*doc, one_document)[0])  # [L, h, hd]
        return torch.cat(out).to(query.dtype)

    monkeypatch.setattr(attention, "varlen_attn", varlen_stand_in)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, s, 8, generator=generator).bfloat16() for heads in (4, 2, 2))
    out = causal_attention(q, k, v, dropout_p=0.0, runs=runs)
    offsets = [0, 5, 14, 15, 24, 35, 48]
    assert calls == [((b * s, 4, 8), (b * s, 2, 8), torch.int32, offsets, offsets, 13, 13, (-1, 0), True)]
    expected = dense_document_attention(q.float(), k.float(), v.float(), ids)
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    # Flash Attention has no dropout and no fp32: those take the per-document path.
    causal_attention(q, k, v, dropout_p=0.1, runs=runs)
    causal_attention(q.float(), k.float(), v.float(), dropout_p=0.0, runs=runs)
    assert len(calls) == 1
