"""Mixtures of experts on a GPU (the ``moe`` stage): the kernel torch runs on this device (``choose_expert_kernel``:
grouped on sm90/sm100 in bf16, else the padded bmm) against a loop over the experts in bf16, forward and backward,
with an expert that receives no row and a layer that receives none; and ``qwen3_moe_tiny`` in bf16 compiled by
inductor under no AC, per-op AC and full AC, Dynamo's graphs and breaks counted, against eager; and expert
parallelism 2 over gloo on the one GPU (both ranks on ``cuda:0``, the all-to-alls staged through the host) against
one process: every gradient, the experts' among them, compared after one full-AC forward and backward. A wrong
divide factor on the experts' FSDP2 group (issue 53: torch 2.13's path over a group of one) is off by 2x there.

bf16 bounds: an output is one expert's product of ``dim`` terms and a weight's gradient a sum over the expert's
rows, each rounded to bf16 once (``tests/numerics.py``'s rule)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from numerics import assert_all_close, assert_close, llama_terms

from torchtune_ac.models import qwen3_moe_tiny
from torchtune_ac.models.families.qwen3_moe import QWEN3_MOE_TINY
from torchtune_ac.models.moe import (
    GROUPED,
    ExpertLayout,
    GroupedExperts,
    MoEArgs,
    choose_expert_kernel,
    choose_expert_kernels_,
    compute_experts,
    dispatch,
    loop_experts,
    moe_router_outputs,
)

DEVICE = torch.device("cuda", 0)
DIM, EXPERT_DIM = 256, 128
LAYOUTS = {"qwen3_moe": ExpertLayout(),
           "gpt_oss": ExpertLayout(in_out=True, interleaved=True, bias=True, activation="clamped_swiglu")}


def _experts(layout: ExpertLayout) -> GroupedExperts:
    experts = GroupedExperts(DIM, MoEArgs(num_experts=8, top_k=2, expert_dim=EXPERT_DIM, experts=layout))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    experts = experts.to(DEVICE, torch.bfloat16)
    choose_expert_kernels_(experts, DEVICE, torch.bfloat16)
    return experts


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("counts", [[40, 0, 7, 100, 0, 3, 60, 30], [0] * 8], ids=["empty-expert", "no-rows"])
def test_the_chosen_kernel_gives_the_loops_outputs_and_gradients_in_bf16(layout, counts):
    capability = torch.cuda.get_device_capability(DEVICE)
    expected_kernel = choose_expert_kernel("cuda", torch.bfloat16, capability, (2 * EXPERT_DIM, DIM, DIM, EXPERT_DIM))
    results = {}
    for name, compute in (("chosen", compute_experts), ("loop", loop_experts)):
        experts = _experts(LAYOUTS[layout])
        assert experts.kernel == expected_kernel
        counts_t = torch.tensor(counts)
        rows = torch.randn(int(counts_t.sum()), DIM, generator=torch.Generator().manual_seed(1)).to(DEVICE,
                                                                                                   torch.bfloat16)
        rows.requires_grad_()
        _, plan = dispatch(torch.zeros(rows.shape[0], DIM, device=DEVICE),
                           torch.repeat_interleave(torch.arange(8), counts_t).unsqueeze(1).to(DEVICE), 8)
        out = compute(experts, rows, plan)
        out.float().square().sum().backward()
        results[name] = {"out": out, "rows": rows.grad, **{n: p.grad for n, p in experts.named_parameters()}}
    for key, value in results["loop"].items():
        if value is None:  # no rows: nothing reaches the weights
            assert results["chosen"][key] is None or not results["chosen"][key].any(), key
            continue
        assert_close(results["chosen"][key].float(), value.float(), terms=2 * DIM + max(counts) + 1,
                     dtype=torch.bfloat16, what=f"{expected_kernel} {key}")
    # An expert that received no row has no gradient (the sm100 issue reported to torch gives it one).
    for e in (e for e, c in enumerate(counts) if c == 0):
        assert not results["chosen"]["down_proj"][e].any()
    print(f"capability {capability}: kernel {expected_kernel} (grouped: {expected_kernel == GROUPED})")


@pytest.mark.parametrize("mode, option", [("none", None), ("selective", "op"), ("full", None)])
def test_a_compiled_bf16_moe_model_is_one_graph_a_kind_of_block_and_matches_eager(mode, option):
    from torch._dynamo.utils import counters

    from torchtune_ac.activation_checkpointing.mechanism import ACMode, ac_plan, apply_ac_plan

    tokens = torch.randint(0, 100, (4, 128), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = qwen3_moe_tiny()
        model.init_weights()
        model = model.to(DEVICE, torch.bfloat16)
        choose_expert_kernels_(model, DEVICE, torch.bfloat16)
        apply_ac_plan(model, ac_plan(ACMode(mode), option, len(model.layers)))
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            for block in model.layers:
                block.compile()
        logits = model(tokens)
        loss = logits.float().logsumexp(-1).mean() + sum(r.logits.float().square().mean()
                                                         for r in moe_router_outputs(model))
        loss.backward()
        losses[compiled] = loss.detach()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2  # the dense block's and the MoE blocks'
    assert_close(losses[True], losses[False], terms=64, dtype=torch.bfloat16, what="loss")


# ---------------------------------------------------------------------------------------------------------------
# Expert parallelism 2 over gloo on one GPU, against one process
# ---------------------------------------------------------------------------------------------------------------

EP_ROWS, EP_LENGTH = 4, 32
# Both layers sparse, 4 experts of 32, 2 per token, without the load-balancing loss (each process's own is not one
# process's over the whole batch), as tests/unit/training/test_expert_parallel.py's Qwen3-MoE.
EP_ARGS = dataclasses.replace(
    QWEN3_MOE_TINY, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64,
    intermediate_dim=128,
    moe=dataclasses.replace(QWEN3_MOE_TINY.moe, num_experts=4, expert_dim=32, dense_layers=(), aux_loss=False))


def _gradients(ctx, parallelism) -> dict[str, torch.Tensor]:
    """EP_ARGS's model assembled by the run's order (full AC, fp32) on ``ctx``, one forward and backward of this
    process's rows of the global batch, scaled as ``train_step`` scales them; every gradient whole, on the host."""
    from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
    from torchtune_ac.memory.features import MemorySettings
    from torchtune_ac.memory.plan import MemoryPlan
    from torchtune_ac.models.families.qwen3_moe import FAMILY
    from torchtune_ac.run.assemble import AssemblyPlan, build_training
    from torchtune_ac.runtime.dtypes import DType
    from torchtune_ac.training.objective import IGNORE_INDEX
    from torchtune_ac.training.step import accumulate_gradients

    with torch.device("meta"):
        model = FAMILY.build(EP_ARGS)
    ac = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode="full", ac_option=None,
                         n_layers=EP_ARGS.n_layers)
    memory = MemoryPlan(ac, MemorySettings())
    plan = AssemblyPlan(dtype=DType.FP32, memory=memory, parallelism=parallelism, seed=7)
    assembled = build_training(model, plan, ctx=ctx, make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))
    tokens = torch.randint(0, EP_ARGS.vocab_size, (EP_ROWS, EP_LENGTH), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    share = EP_ROWS // ctx.world_size  # expert parallelism splits the data as FSDP2 does: each process its rows
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
    batch = {"tokens": tokens[rows].to(ctx.device), "labels": labels[rows].to(ctx.device)}
    targets = int((labels != IGNORE_INDEX).sum())
    accumulate_gradients(assembled.model, assembled.stepper, [batch], scale=ctx.world_size / targets,
                         objective=memory.objective())
    grads = {}
    for name, param in assembled.model.named_parameters():  # the same order on every rank (full_tensor gathers)
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[name] = grad.detach().float().cpu()
    return grads


def expert_parallel_gradients(rank: int, world: int, port: int, out: str, device_type: str) -> None:
    """Rank ``rank`` of ``world`` gloo processes on ``device_type`` (all on device 0): rank 0 first computes one
    process's gradients alone, then every rank those of EP ``world``; rank 0 saves both to ``out``."""
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.runtime.parallelism import Parallelism

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        alone = _gradients(DistributedContext(0, 1, 0, device), Parallelism(1)) if rank == 0 else None
        parallelism = Parallelism(world, expert=world)
        split = _gradients(DistributedContext(rank, world, 0, device, parallelism=parallelism), parallelism)
        if rank == 0:
            torch.save({"alone": alone, "split": split}, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_expert_parallel_gradients(out: Path, device_type: str) -> dict[str, dict[str, torch.Tensor]]:
    """``expert_parallel_gradients`` on 2 spawned processes; what rank 0 saved."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(expert_parallel_gradients, args=(2, port, str(out), device_type), nprocs=2,
                       start_method="spawn")
    return torch.load(out)


def assert_expert_parallel_gradients_match(result: dict[str, dict[str, torch.Tensor]]) -> None:
    alone, split = result["alone"], result["split"]
    experts = [name for name in alone if ".experts." in name]
    assert experts and all(alone[name].abs().sum() > 0 for name in experts), sorted(alone)
    # The split sums each gradient's terms in another order (rule 3), in float32.
    assert_all_close(split, alone, terms=llama_terms(EP_ARGS, EP_LENGTH, EP_ROWS * EP_LENGTH),
                     what="EP 2 against one process:")


def test_expert_parallel_2_over_gloo_on_one_gpu_gives_one_process_s_gradients(tmp_path, record_property):
    result = run_expert_parallel_gradients(tmp_path / "gradients.pt", "cuda")
    record_property("expert_gradients", len([n for n in result["alone"] if ".experts." in n]))
    record_property("torch", torch.__version__)
    assert_expert_parallel_gradients_match(result)
