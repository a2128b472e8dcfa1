"""``LoRALinear``, the fused LoRA forward and backward, against the unfused arithmetic (``AdaptedLinear.adapted``),
and the cases it must leave to the unfused path."""

import pytest
import torch
from torch import nn

from tests.numerics import assert_close
from torchtune_ac.lora.config import AdapterConfig
from torchtune_ac.lora.mechanism import LoRALinear, _fusable, apply_adapters

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

