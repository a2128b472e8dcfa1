"""``LoRALinear``, the fused LoRA forward and backward, against the unfused arithmetic (``AdaptedLinear.adapted``),
and the cases it must leave to the unfused path."""

import dataclasses

import pytest
import torch
from models_testlib import build_random_llama
from torch import nn

from tests.numerics import assert_close, llama_terms
from torchtune_ac.activation_checkpointing.mechanism import ACMode, ac_plan, apply_ac_plan
from torchtune_ac.lora.config import AdapterConfig, AdapterKind
from torchtune_ac.lora.mechanism import AdaptedLinear, LoRAGroup, LoRALinear, _fusable, apply_adapters
from torchtune_ac.models import LlamaArgs

IN, OUT, RANK, TOKENS = 48, 96, 4, 2 * 5


def _adapted(bias: bool, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("q_proj", nn.Linear(IN, OUT, bias=bias))
    apply_adapters(model, AdapterConfig(rank=RANK, alpha=2 * RANK + 3, dropout=dropout, targets=["q_proj"]))
    linear = model.q_proj
    with torch.no_grad():  # B is zero after PEFT's initialisation: give the update a value of its own
        linear.lora_a.weight.normal_()
        linear.lora_b.weight.normal_()
    return linear


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("input_grad", [True, False])
def test_fused_equals_the_unfused_arithmetic(bias, input_grad):
    """Output and every gradient (x, A, B) as ``adapted``'s composition of linears; no gradient for the frozen base.
    Both sides sum the same products in another order: within the rounding of IN + RANK terms (forward) and of the
    tokens summed into A's and B's gradients."""
    linear = _adapted(bias)
    assert _fusable(linear, torch.zeros(1, IN))
    x = torch.randn(2, 5, IN, requires_grad=input_grad)
    grad = torch.randn(2, 5, OUT)
    results = []
    for fused in (True, False):
        linear.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(input_grad)
        out = linear(xi) if fused else linear.adapted(xi, linear.base_forward(xi))
        out.backward(grad)
        results.append((out.detach(), xi.grad, linear.lora_a.weight.grad, linear.lora_b.weight.grad))
    (out, gx, ga, gb), (ref_out, ref_gx, ref_ga, ref_gb) = results
    assert_close(out, ref_out, terms=IN + RANK)
    assert_close(ga, ref_ga, terms=OUT + TOKENS)
    assert_close(gb, ref_gb, terms=IN + TOKENS)
    assert (gx is None) == (not input_grad)
    if input_grad:
        assert_close(gx, ref_gx, terms=OUT + RANK)
    assert linear.weight.grad is None and (linear.bias is None or linear.bias.grad is None)


def test_fused_only_where_its_arithmetic_holds():
    """Dropout in training puts a mask between x and A, a trained base needs its own gradient, another dtype needs a
    cast: those run the unfused path (which LoRALinear would compute wrong)."""
    x = torch.zeros(1, IN)
    dropped = _adapted(False, dropout=0.1)
    assert not _fusable(dropped.train(), x) and _fusable(dropped.eval(), x)
    trained = _adapted(False)
    trained.weight.requires_grad_(True)
    assert not _fusable(trained, x)
    assert not _fusable(_adapted(False), x.double())
    calls = []
    original = LoRALinear.apply
    try:
        LoRALinear.apply = lambda *args: calls.append(args) or original(*args)
        _adapted(False)(x)
        dropped.train()(x)
    finally:
        LoRALinear.apply = original
    assert len(calls) == 1



# Grouped projections: a tiny Llama (grouped-query attention, q/k/v biases as Qwen2's) with adapters everywhere.
LLAMA = LlamaArgs(vocab_size=64, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=80, max_seq_len=32,
                  qkv_bias=True)
EVERY = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GROUPS = {  # targets, kind -> LoRAGroup calls per forward: attention's and the MLP's per block where all are adapted
    "every projection": (EVERY, AdapterKind.LORA, 2 * LLAMA.n_layers),
    "k and gate left out": (["q_proj", "v_proj", "up_proj", "down_proj"], AdapterKind.LORA, 0),
    "dora": (EVERY, AdapterKind.DORA, 0),
}


def _loss_and_adapter_grads(targets, kind, ac_mode="none", ac_option=None):
    model = build_random_llama(LLAMA, seed=0).train()
    apply_adapters(model, AdapterConfig(rank=RANK, alpha=2 * RANK + 3, kind=kind, targets=targets))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every adapter nonzero, each its own values
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3 + (1 if "magnitude" in name else 0))
    apply_ac_plan(model, ac_plan(ACMode(ac_mode), ac_option, LLAMA.n_layers))
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 12), generator=generator)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", sorted(GROUPS))
def test_grouped_projections_train_as_the_linears_one_by_one(case, monkeypatch):
    """Loss and every adapter's gradient as the fused linears one by one (``forward_shared`` switched off), within
    the rounding of a Llama's backward (the input's gradient summed in another order); and ``LoRAGroup`` ran
    exactly where every linear of a shared input is plainly LoRA-adapted."""
    targets, kind, groups = GROUPS[case]
    calls = []
    original = LoRAGroup.apply
    monkeypatch.setattr(LoRAGroup, "apply", lambda *args: calls.append(len(args)) or original(*args))
    loss, grads = _loss_and_adapter_grads(targets, kind)
    assert len(calls) == groups
    monkeypatch.setattr(AdaptedLinear, "forward_shared", lambda self, x, linears: None)
    ref_loss, ref_grads = _loss_and_adapter_grads(targets, kind)
    assert len(calls) == groups
    terms = llama_terms(LLAMA, 12, 24)
    assert_close(loss, ref_loss, terms=terms)
    assert grads.keys() == ref_grads.keys() and any("k_proj.lora_a" in name for name in grads) == (case != "k and gate left out")
    for name, grad in grads.items():
        assert_close(grad, ref_grads[name], terms=terms, what=name)


@pytest.mark.parametrize("ac", [("full", None), ("selective", "op")])
def test_grouped_projections_under_activation_checkpointing_train_as_without(ac):
    """Full AC replays the groups; per-op AC keeps their matrix multiplies' outputs and refuses one mutated after
    (the update is added out of place under its dispatch mode): the same loss and gradients as without AC."""
    loss, grads = _loss_and_adapter_grads(EVERY, AdapterKind.LORA)
    ac_loss, ac_grads = _loss_and_adapter_grads(EVERY, AdapterKind.LORA, *ac)
    terms = llama_terms(LLAMA, 12, 24)
    assert_close(ac_loss, loss, terms=terms)
    for name, grad in grads.items():
        assert_close(ac_grads[name], grad, terms=terms, what=name)
