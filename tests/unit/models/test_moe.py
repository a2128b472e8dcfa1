"""The mixture-of-experts layer (``models/moe.py``): routing, dispatch and combine, the grouped matmul and its
fallback against a loop over the experts, and the load-balancing loss against transformers'."""

import pytest
import torch
from compile_testlib import compile_blocks_counted, graphs_and_breaks
from numerics import assert_close
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from torchtune_ac.models.moe import (
    GROUPED,
    PADDED_BMM,
    ExpertLayout,
    GroupedExperts,
    MoE,
    MoEArgs,
    RouterSpec,
    _padded_bmm,
    choose_expert_kernel,
    combine,
    compute_experts,
    dispatch,
    grouped_mm,
    load_balancing_loss,
    loop_experts,
    route,
)

DIM, EXPERT_DIM, TOKENS = 32, 16, 40
LAYOUTS = {
    "qwen3_moe": ExpertLayout(),
    "gpt_oss": ExpertLayout(in_out=True, interleaved=True, bias=True, activation="clamped_swiglu"),
}


def _experts(layout: ExpertLayout, num_experts: int = 4, seed: int = 0) -> GroupedExperts:
    experts = GroupedExperts(DIM, MoEArgs(num_experts=num_experts, top_k=2, expert_dim=EXPERT_DIM, experts=layout))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return experts


def _rows(counts: list[int], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    counts_t = torch.tensor(counts)
    return torch.randn(int(counts_t.sum()), DIM, generator=torch.Generator().manual_seed(seed)), counts_t


def test_routing_as_transformers_routers():
    logits = torch.randn(TOKENS, 6, generator=torch.Generator().manual_seed(0))
    # Qwen3-MoE: softmax in float32, top k, renormalised.
    weights, experts = route(logits, RouterSpec(norm_topk_prob=True), 2)
    probs = logits.softmax(-1)
    top, index = probs.topk(2, dim=-1)
    assert torch.equal(experts, index) and torch.equal(weights, top / top.sum(-1, keepdim=True))
    weights, _ = route(logits, RouterSpec(norm_topk_prob=False), 2)
    assert torch.equal(weights, top)
    # gpt-oss: top k of the logits, softmax over those k.
    weights, experts = route(logits, RouterSpec(scoring="topk_softmax", bias=True), 3)
    top, index = logits.topk(3, dim=-1)
    assert torch.equal(experts, index) and torch.equal(weights, top.softmax(-1))


def test_dispatch_sorts_every_copy_by_expert_and_combine_puts_them_back():
    x = torch.randn(5, DIM)
    experts = torch.tensor([[2, 0], [1, 2], [2, 3], [0, 1], [3, 2]])
    rows, plan = dispatch(x, experts, 5)
    assert plan.counts.tolist() == [2, 2, 4, 2, 0]  # dropless: all 10 copies, the empty expert included
    assert plan.experts.tolist() == [0, 0, 1, 1, 2, 2, 2, 2, 3, 3]
    assert torch.equal(rows[:2], x[[0, 3]]) and torch.equal(rows[4:8], x[[0, 1, 2, 4]])  # in token order
    weights = torch.rand(5, 2)
    out = combine(rows * 2, plan, weights)
    assert torch.equal(out, 2 * x * weights[:, :1] + 2 * x * weights[:, 1:])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_grouped_matmul_equals_a_loop_over_the_experts(layout, dtype):
    experts = _experts(LAYOUTS[layout]).to(dtype)
    rows, counts = _rows([7, 0, 12, 5])  # an expert without tokens too
    rows = rows.to(dtype)
    _, plan = dispatch(torch.zeros(24, DIM), torch.repeat_interleave(torch.arange(4), counts).unsqueeze(1), 4)
    assert experts.kernel == GROUPED  # CPU, float32 and bfloat16
    # The same products, each row's own dot products in both: equal bit for bit (torch 2.13's CPU kernel).
    assert torch.equal(compute_experts(experts, rows, plan), loop_experts(experts, rows, plan))


def test_the_grouped_matmul_gives_the_gradients_of_the_loop():
    grads = {}
    for name, compute in (("grouped", compute_experts), ("loop", loop_experts)):
        experts = _experts(LAYOUTS["gpt_oss"])
        rows, counts = _rows([3, 9, 0, 6])
        rows.requires_grad_()
        _, plan = dispatch(torch.zeros(18, DIM), torch.repeat_interleave(torch.arange(4), counts).unsqueeze(1), 4)
        compute(experts, rows, plan).square().sum().backward()
        grads[name] = {"rows": rows.grad, **{n: p.grad for n, p in experts.named_parameters()}}
    for name, grad in grads["loop"].items():
        # Weight gradients sum over an expert's rows in another order: within the rounding of that many terms.
        assert_close(grads["grouped"][name], grad, terms=2 * DIM + EXPERT_DIM + 9, what=name)


def test_the_fallback_pads_to_the_busiest_expert_and_gives_the_same_products():
    weight = torch.randn(4, DIM, 8)
    rows, counts = _rows([2, 11, 0, 5])
    expected = torch.cat([r @ weight[e] for e, r in enumerate(rows.split(counts.tolist()))])
    assert_close(_padded_bmm(rows, weight, counts), expected, terms=DIM, what="padded bmm")
    # Where _grouped_mm's alignment rule fails (rows of 12 bytes), the fallback is chosen.
    odd = torch.randn(4, 3, 8)
    assert choose_expert_kernel("cpu", torch.float32, None, (3, 8)) == PADDED_BMM
    assert_close(grouped_mm(rows[:, :3].contiguous(), odd, counts, PADDED_BMM),
                 torch.cat([r[:, :3] @ odd[e] for e, r in enumerate(rows.split(counts.tolist()))]), terms=3)


# (device, dtype, capability) -> kernel: torch 2.13's grouped kernel on a CPU in float32 and bfloat16, and on CUDA
# in bfloat16 on sm90 and sm100 only; Ampere, Ada, sm120 and float32 on CUDA take the padded bmm.
KERNEL_CHOICES = [
    ("cpu", torch.float32, None, GROUPED),
    ("cpu", torch.bfloat16, None, GROUPED),
    ("cpu", torch.float16, None, PADDED_BMM),
    ("cuda", torch.bfloat16, (9, 0), GROUPED),  # H100, H200
    ("cuda", torch.bfloat16, (10, 0), GROUPED),  # B200
    ("cuda", torch.bfloat16, (10, 3), GROUPED),  # B300
    ("cuda", torch.bfloat16, (12, 0), PADDED_BMM),  # RTX 50xx, RTX PRO 6000: torch loops with a host sync there
    ("cuda", torch.bfloat16, (8, 0), PADDED_BMM),  # A100
    ("cuda", torch.bfloat16, (8, 9), PADDED_BMM),  # L40S
    ("cuda", torch.float32, (9, 0), PADDED_BMM),
    ("mps", torch.bfloat16, None, PADDED_BMM),
]


@pytest.mark.parametrize("device, dtype, capability, kernel", KERNEL_CHOICES)
def test_the_kernel_is_chosen_as_torch_runs_it(device, dtype, capability, kernel):
    assert choose_expert_kernel(device, dtype, capability, (64, 32, 16, 64)) == kernel


def test_the_kernel_is_chosen_once_for_the_device_the_model_is_placed_on(monkeypatch):
    """``choose_expert_kernels_`` asks the capability once per call, not per layer or forward (mocked: no GPU)."""
    from torchtune_ac.models import qwen3_moe_tiny
    from torchtune_ac.models.moe import GroupedExperts, choose_expert_kernels_

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (8, 0))
    model = qwen3_moe_tiny()
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert len(experts) > 1 and {e.kernel for e in experts} == {GROUPED}
    choose_expert_kernels_(model, torch.device("cuda", 0), torch.bfloat16)
    assert len(asked) == 1 and {e.kernel for e in experts} == {PADDED_BMM}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    choose_expert_kernels_(model, torch.device("cuda", 0), torch.bfloat16)
    assert {e.kernel for e in experts} == {GROUPED}


def test_the_layer_returns_its_routing_and_the_decoder_keeps_it_for_the_loss_and_the_metrics():
    from torchtune_ac.models import qwen3_moe_tiny
    from torchtune_ac.models.moe import moe_router_outputs

    moe = MoE(DIM, MoEArgs(num_experts=4, top_k=2, expert_dim=EXPERT_DIM))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, DIM)
    out, logits, counts = moe(x)
    assert out.shape == x.shape and moe.router_output is None  # returned, not kept by the layer itself
    assert logits.shape == (10, 4) and logits.requires_grad
    assert int(counts.sum()) == 20  # every token's 2 copies
    model = qwen3_moe_tiny()
    model.init_weights()
    model(torch.randint(0, 100, (2, 6)))
    recorded = moe_router_outputs(model)
    moe_layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(recorded) == len(moe_layers) > 1
    assert all(r.logits.shape == (12, m.args.num_experts) and int(r.counts.sum()) == 12 * m.args.top_k
               for r, m in zip(recorded, moe_layers))


@pytest.mark.parametrize("masked", [False, True])
def test_the_load_balancing_loss_is_transformers(masked):
    generator = torch.Generator().manual_seed(3)
    logits = [torch.randn(12, 6, generator=generator) for _ in range(3)]
    mask = (torch.rand(2, 6, generator=generator) > 0.3).long() if masked else None
    expected = load_balancing_loss_func(tuple(logits), 6, 2, mask)
    # The same reductions in the same order (float32 sums over the layers): equal bit for bit.
    assert torch.equal(load_balancing_loss(logits, 6, 2, mask), expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_packed_row_gives_each_document_the_logits_it_has_alone(tmp_path, family):
    """Packing: attention (gpt-oss's with sinks and a 6-token window included) stays within each document, and
    routing is per token, so a packed row's logits are each document's own."""
    from hf_families import write_hf_checkpoint
    from numerics import llama_terms

    from torchtune_ac.models import load_hf

    model = load_hf(write_hf_checkpoint(family, tmp_path, seed=6)).eval()
    generator = torch.Generator().manual_seed(1)
    documents = [torch.randint(0, 96, (1, n), generator=generator) for n in (9, 14)]
    row = torch.cat(documents, dim=1)
    document_ids = torch.cat([torch.full((1, d.shape[1]), i) for i, d in enumerate(documents)], dim=1)
    with torch.no_grad():
        packed = model(row, document_ids)
        alone = torch.cat([model(d) for d in documents], dim=1)
    # The same documents through kernels of other shapes: within rounding.
    assert_close(packed, alone, terms=llama_terms(model.args, 14, 0, backward=False), what="packed logits")


@pytest.mark.parametrize("mode, option", [("none", None), ("selective", "op"), ("full", None)])
def test_a_compiled_moe_block_is_one_graph_without_breaks_under_every_ac_mode(mode, option):
    """``block.compile()`` on a tiny Qwen3-MoE (a dense block, then MoE blocks) under each AC mode: Dynamo makes
    one graph per kind of block and breaks none (the router's outputs are returned, float32's grouped matmul is an
    op with a shape function), and forward and backward give eager's numbers. (aot_eager: the graphs and the
    autograd of inductor's path, without its code generation.)"""
    from torchtune_ac.activation_checkpointing.mechanism import ACMode, ac_plan, apply_ac_plan
    from torchtune_ac.models import qwen3_moe_tiny
    from torchtune_ac.models.moe import moe_router_outputs

    results = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = qwen3_moe_tiny()
        model.init_weights()
        apply_ac_plan(model, ac_plan(ACMode(mode), option, len(model.layers)))
        compile_blocks_counted(model, compiled)
        logits = model(torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1)))
        aux = sum(r.logits.square().mean() for r in moe_router_outputs(model))
        (logits.square().mean() + aux).backward()
        results[compiled] = (logits, [p.grad for p in model.parameters()])
    assert graphs_and_breaks() == (2, {})  # the dense block's graph and the MoE blocks', no break
    # The same ops in the same order, each replayed as eager runs it: equal bit for bit.
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
