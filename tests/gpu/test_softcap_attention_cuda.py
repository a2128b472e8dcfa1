"""Soft-capped attention on CUDA (Gemma 2): the compiled FlexAttention path against the explicit-scores path (what a
CPU runs, checked against transformers there), on whole and packed rows with a sliding and a global layer, in bf16,
in every AC mode; one FlexAttention call per layer. The tolerance is bf16's, as in ``test_packed_attention_cuda``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtune_ac.models import attention
from torchtune_ac.models.families.gemma2 import FAMILY as GEMMA2
from torchtune_ac.models.families.gemma2 import GEMMA2_2B
from torchtune_ac.activation_checkpointing.config import setup_activation_checkpointing

BF16_TOLERANCE = 2e-2
VOCAB, SEQ = 512, 256
# Every AC mode once, packed and unpacked alternating (4 runs: each compiles FlexAttention for its shapes).
CASES = [("none", None, False), ("full", None, True), ("selective", 1, False), ("selective", "op", True)]
# Caps low enough to bend the scores and logits of weights at std 0.05.
ARGS = dataclasses.replace(GEMMA2_2B, vocab_size=VOCAB, dim=256, n_layers=2, n_heads=8, n_kv_heads=2, head_dim=None,
                           intermediate_dim=512, max_seq_len=SEQ, sliding_window=64, query_pre_attn_scalar=32,
                           layer_types=("sliding_attention", "full_attention"), attn_logit_softcapping=0.5,
                           final_logit_softcapping=2.0)


def explicit_scores(q, k, v, *, runs, gqa, scale, window, softcap, kernel=None):
    """The explicit-scores path, standing in for FlexAttention."""
    if runs is None:
        return attention._explicit_attention(q, k, v, dropout_p=0.0, gqa=gqa, scale=scale, window=window,
                                               softcap=softcap).transpose(1, 2)
    return attention._per_document_attention(q, k, v, runs=runs, dropout_p=0.0, gqa=gqa, scale=scale, window=window,
                                             softcap=softcap)


def build():
    torch.manual_seed(0)
    model = GEMMA2.build(ARGS)
    model.init_weights(std=0.05)
    return model.to(device="cuda", dtype=torch.bfloat16)


def forward_backward(model, tokens, ids):
    model.zero_grad(set_to_none=True)
    logits = model(tokens, ids)
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach().float(), {name: p.grad.float() for name, p in model.named_parameters()}


def assert_near(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert torch.isfinite(actual).all(), f"{what}: not finite"
    error = float((actual - expected).norm() / expected.norm())
    assert error <= BF16_TOLERANCE, f"{what}: |difference| / |expected| = {error:.3g} > {BF16_TOLERANCE}"


@pytest.mark.parametrize("mode, option, packed", CASES, ids=["none-unpacked", "full-packed", "every-block-unpacked",
                                                             "per_op-packed"])
def test_compiled_flex_attention_equals_the_explicit_scores_in_bf16(monkeypatch, packed, mode, option):
    rows = [[17, 100, 1, 138], [SEQ]]
    ids = (torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).cuda()
           if packed else None)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1)).cuda()
    with monkeypatch.context() as patch:
        patch.setattr(attention, "flex_explicit_attention", explicit_scores)
        expected_logits, expected_grads = forward_backward(build(), tokens, ids)
    calls = []
    compiled = attention._COMPILED_FLEX_ATTENTION
    monkeypatch.setattr(attention, "_COMPILED_FLEX_ATTENTION", lambda *a, **k: calls.append(1) or compiled(*a, **k))
    model = build()
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    logits, grads = forward_backward(model, tokens, ids)
    assert len(calls) >= ARGS.n_layers  # one call per layer (and again where AC recomputes a block)
    assert_near(logits, expected_logits, "logits")
    for name, grad in expected_grads.items():
        assert_near(grads[name], grad, name)
