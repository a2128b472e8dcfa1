"""The memory planner: its simulation matches what a real step keeps and peaks at, its extrapolation matches a
whole-depth simulation, and ``ac_mode: auto`` picks the least recompute that fits (or says what is missing)."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch
from _measure import measure_saved_activation_bytes

from torchtune_ac.config.components import Component
from torchtune_ac.errors import UserError
from torchtune_ac.memory.feature import OptimizerSpec
from torchtune_ac.memory.plan import MemoryConfig, PlannerInputs, budget_gib, resolve_memory_plan
from torchtune_ac.models.families.gemma3 import GEMMA3_1B
from torchtune_ac.models.llama import Llama
from torchtune_ac.memory.features import MemorySettings
from torchtune_ac.memory.planner.simulation import _simulate
from torchtune_ac.memory.planner import (
    GiB,
    Workload,
    candidate_plans,
    choose_plan,
    describe_setting,
    estimate_memory,
    switch_ablation,
)
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
from torchtune_ac.activation_checkpointing.config import ACConfig, ACConfigError
from torchtune_ac.activation_checkpointing.mechanism import ACMode
from torchtune_ac.memory.chunked_loss import loss_objective
from torchtune_ac.runtime.parallelism import Parallelism

REPO = Path(__file__).resolve().parents[3]
SMALL = Component(key="model", path="torchtune_ac.models.llama_small")
# Activations outweigh the optimizer step at this size, so the plans differ.
WORKLOAD = Workload(batch_size=2, seq_len=512)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-5)


@pytest.fixture(scope="module")
def small_estimates():
    return estimate_memory(SMALL.instantiate, adamw, WORKLOAD)


def test_candidates_run_from_the_least_recompute_to_the_most():
    assert [describe_setting(p) for p in candidate_plans(8)] == [
        "none", "per-op", "every 4th block", "every 2nd block", "full"]
    assert [describe_setting(p) for p in candidate_plans(2)] == ["none", "per-op", "every 2nd block", "full"]
    assert [describe_setting(p) for p in candidate_plans(1)] == ["none", "per-op", "full"]


def test_saved_activations_equal_what_a_real_forward_keeps(small_estimates):
    tokens = torch.randint(0, 8192, (2, 512), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    for estimate in small_estimates:
        torch.manual_seed(0)
        model = SMALL.instantiate()
        plan = estimate.plan
        setup_activation_checkpointing(model, ac_mode=plan.mode.value, ac_option=plan.option)
        # The run's loss at loss_chunks 1 (the targets' logits through the head, their gradients kept from forward).
        measured = measure_saved_activation_bytes(lambda t: loss_objective(1)(model, {"tokens": t, "labels": labels}),
                                                  tokens, exclude=list(model.parameters()))
        assert estimate.saved_activations == pytest.approx(measured, rel=0.01), describe_setting(plan)


# A Gemma 3 block's parts (float32 norms with an offset, GeGLU, norms on queries and keys, sliding and full layers)
# in a tiny model: its pointwise work is what a compiled block recomputes rather than saves.
GEMMA3_LIKE = dataclasses.replace(GEMMA3_1B, vocab_size=256, dim=64, intermediate_dim=192, n_layers=4, n_heads=4,
                                  n_kv_heads=2, head_dim=None, max_seq_len=256, sliding_window=32,
                                  query_pre_attn_scalar=16, layer_types=("sliding_attention", "full_attention") * 2)


@pytest.mark.parametrize("name", ["llama_small", "gemma3_like"])
def test_compiled_blocks_are_simulated_saving_what_inductor_saves(name):
    """``compile: true``: a block without AC saves fewer tensors than eager (inductor's partitioner recomputes
    pointwise results in backward). The estimate equals what the model with each block compiled by inductor, here
    on the CPU, keeps for backward; a checkpointed block keeps its inputs either way."""
    build = SMALL.instantiate if name == "llama_small" else lambda: Llama(GEMMA3_LIKE)
    vocab, workload = (8192, WORKLOAD) if name == "llama_small" else (256, Workload(batch_size=2, seq_len=256))
    tokens = torch.randint(0, vocab, (workload.batch_size, workload.seq_len),
                           generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    plans = [p for p in candidate_plans(len(build().layers))
             if describe_setting(p) in ("none", "every 2nd block", "full")]
    eager = {describe_setting(e.plan): e.saved_activations for e in estimate_memory(build, adamw, workload, plans)}
    compiled = estimate_memory(build, adamw, dataclasses.replace(workload, compiled=True), plans)
    torch._dynamo.reset()
    try:
        for estimate in compiled:
            torch.manual_seed(0)
            model = build()
            setup_activation_checkpointing(model, ac_mode=estimate.plan.mode.value, ac_option=estimate.plan.option)
            for block in model.layers:
                block.compile()
            measured = measure_saved_activation_bytes(
                lambda t: loss_objective(1)(model, {"tokens": t, "labels": labels}), tokens,
                exclude=list(model.parameters()), compiled=True)
            # A compiled checkpointed block also saves the generator's state, to replay dropout (5,056 bytes on a
            # CPU, 16 on CUDA; eager, it is kept outside autograd's saved tensors): not counted.
            measured -= len(estimate.plan.checkpointed_blocks) * torch.get_rng_state().numel()
            assert estimate.saved_activations == pytest.approx(measured, rel=0.01), describe_setting(estimate.plan)
    finally:
        torch._dynamo.reset()
    saved = {describe_setting(e.plan): e.saved_activations for e in compiled}
    assert saved["none"] < 0.85 * eager["none"] and saved["every 2nd block"] < eager["every 2nd block"]
    assert saved["full"] == eager["full"]


def test_compiled_blocks_are_split_by_inductor_s_partition_with_the_parameters_free_to_save(monkeypatch):
    """The simulation splits a block's joint graph as inductor does: its ``partition_fn`` (the joint-graph passes,
    then the min-cut partitioner), told that the block's parameters (its flat inputs first) live for the whole step.
    On the CPU cases above, neither changes what is saved (docs/memory.md): this checks the path is inductor's."""
    from torch._inductor import compile_fx

    indices = []
    real = compile_fx.partition_fn

    def partition_fn(joint, joint_inputs, **kwargs):
        indices.append(kwargs.get("static_lifetime_input_indices"))
        return real(joint, joint_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "partition_fn", partition_fn)
    tiny = Component(key="model", path="torchtune_ac.models.llama_tiny").instantiate
    plans = candidate_plans(8)[:1]  # none
    estimate_memory(tiny, adamw, Workload(batch_size=1, seq_len=64, compiled=True), plans)
    block = tiny().layers[0]
    state = len(list(block.parameters())) + len(list(block.buffers()))
    assert state > 0 and indices and all(i == list(range(state)) for i in indices), (state, indices)


class _MixingBlock(torch.nn.Module):
    """Blocks alike in their parameters that differ in a plain attribute or argument: whether they mix tokens (a
    causal attention of the projected input with itself, no parameters of its own)."""

    def __init__(self, mix: bool) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.proj = torch.nn.Linear(64, 64)
        self.mix = mix

    def forward(self, x: torch.Tensor, mix: Optional[bool] = None) -> torch.Tensor:
        h = self.proj(self.norm(x))
        if self.mix if mix is None else mix:
            h = h.unsqueeze(1)
            h = torch.nn.functional.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1)
        return x + h


class _MixingModel(torch.nn.Module):
    """A custom model (no family of ours) of ``_MixingBlock``s: every 2nd mixes, told by an attribute or argument."""

    def __init__(self, by: str) -> None:
        super().__init__()
        self.by = by
        self.emb = torch.nn.Embedding(128, 64)
        self.layers = torch.nn.ModuleList(_MixingBlock(by == "attribute" and i % 2 == 1) for i in range(4))
        self.out = torch.nn.Linear(64, 128, bias=False)

    def forward(self, tokens, document_ids=None, head=None, document_lengths=None):
        h = self.emb(tokens)
        for i, layer in enumerate(self.layers):
            h = layer(h) if self.by == "attribute" else layer(h, i % 2 == 1)
        return self.out(h) if head is None else head(h, self.out.weight)


@pytest.mark.parametrize("by", ["attribute", "argument"])
def test_compiled_blocks_alike_in_parameters_but_not_in_what_they_compute_are_traced_apart(by):
    """The trace of one block serves another only when both compute the same graph: a block that mixes tokens and
    one that does not (same parameters) keep different tensors for backward, as inductor compiles them."""
    workload = Workload(batch_size=2, seq_len=256, compiled=True)
    plans = [p for p in candidate_plans(4) if describe_setting(p) == "none"]
    (estimate,) = estimate_memory(lambda: _MixingModel(by), adamw, workload, plans)
    tokens = torch.randint(0, 128, (2, 256), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, dims=1)
    torch._dynamo.reset()
    try:
        model = _MixingModel(by)
        for block in model.layers:
            block.compile()
        measured = measure_saved_activation_bytes(lambda t: loss_objective(1)(model, {"tokens": t, "labels": labels}),
                                                  tokens, exclude=list(model.parameters()), compiled=True)
    finally:
        torch._dynamo.reset()
    assert estimate.saved_activations == pytest.approx(measured, rel=0.01)


def test_a_block_the_compiled_trace_cannot_take_is_planned_as_eager_with_one_warning(monkeypatch, caplog):
    from torchtune_ac.memory.planner import simulation

    def fails(block, forward):
        raise RuntimeError("an op the trace does not know\nmore lines")

    tiny = Component(key="model", path="torchtune_ac.models.llama_tiny").instantiate
    workload = Workload(batch_size=1, seq_len=64)
    plans = candidate_plans(8)[:1]
    (eager,) = estimate_memory(tiny, adamw, workload, plans)
    monkeypatch.setattr(simulation, "_aot_block", fails)
    monkeypatch.setattr(simulation, "_WARNED", set())
    compiled = [estimate_memory(tiny, adamw, dataclasses.replace(workload, compiled=True), plans)[0] for _ in range(2)]
    assert [e.saved_activations for e in compiled] == [eager.saved_activations] * 2
    assert [r.getMessage() for r in caplog.records if r.name == "torchtune_ac.memory"] == [
        "compile: true: the planner could not trace TransformerBlock as compiled (RuntimeError: an op the trace does "
        "not know); it plans the block as eager, which keeps more for backward than the compiled block will"]


def test_extrapolation_from_shallow_models_equals_the_whole_depth(small_estimates):
    for estimate in small_estimates:
        plan = estimate.plan
        whole = _simulate(SMALL.instantiate, adamw, plan.mode.value, plan.option, None, WORKLOAD)
        peak = max(p.value for p in whole.peaks.values())
        assert estimate.step_peak == pytest.approx(peak + whole.batch, rel=0.03), describe_setting(plan)
        assert estimate.saved_activations == pytest.approx(whole.saved_activations, rel=0.01)
        assert estimate.flops == pytest.approx(whole.flops, rel=0.01)


def test_recompute_flops_follow_the_checkpointed_blocks(small_estimates):
    extra = {describe_setting(e.plan): e.extra_flops for e in small_estimates}
    assert extra["none"] == 0 and extra["per-op"] == 0  # per-op AC recomputes no matrix multiply
    assert extra["every 4th block"] == pytest.approx(extra["full"] / 4, rel=0.01)
    assert extra["every 2nd block"] == pytest.approx(extra["full"] / 2, rel=0.01)
    assert 0.15 < extra["full"] < 0.35


MEASURE_STEPS = textwrap.dedent("""
    import gc, json, sys, psutil, torch
    from torchtune_ac.config.components import Component
    from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.parallel.fsdp import FSDPConfig
    from torchtune_ac.runtime.dtypes import DType
    from _measure import return_freed_memory_to_os, track_peak_rss
    from torchtune_ac.config.meta_model import build_meta_model
    from torchtune_ac.run.assemble import AssemblyPlan, build_training
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.memory.plan import MemoryPlan
    from torchtune_ac.training.step import train_step
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    tokens = torch.randint(0, 8192, (2, 512))
    batch = [{"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}]
    measured = []
    for mode, chunks in json.loads(sys.argv[1]):
        plan = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=mode, ac_option=None, n_layers=8)
        model = build_training(build_meta_model(Component(key="model", path="torchtune_ac.models.llama_small")),
                               AssemblyPlan(dtype=DType.FP32, memory=MemoryPlan(ac=plan),
                                            seed=0), ctx=ctx).model
        optimizer = build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-5), model, in_backward=False)
        train_step(model, optimizer, batch, ctx=ctx, objective=loss_objective(chunks))  # allocates the optimizer state
        return_freed_memory_to_os()
        before = psutil.Process().memory_info().rss
        with track_peak_rss() as peak:
            train_step(model, optimizer, batch, ctx=ctx, objective=loss_objective(chunks))
        measured.append(peak.peak_bytes - before)
        del model, optimizer
        gc.collect()
    print(json.dumps(measured))
""")
# (ac_mode, loss_chunks) measured in one process.
MEASURED_SETTINGS = [("none", 1), ("full", 1), ("full", 4)]


def test_estimated_step_peak_is_within_15_percent_of_a_measured_step():
    # glibc's malloc keeps the pages of freed tensors below its mmap threshold (which it raises as big tensors
    # are freed); with the threshold fixed, RSS follows the live tensors, which is what the planner estimates
    # (and what CUDA's max_memory_allocated reports).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", MEASURE_STEPS, json.dumps(MEASURED_SETTINGS)],
                            capture_output=True, text=True, env=env, check=True)
    measured = json.loads(result.stdout.split("\n")[-2])
    for (mode, chunks), bytes_ in zip(MEASURED_SETTINGS, measured):
        workload = Workload(batch_size=2, seq_len=512, settings=MemorySettings(loss_chunks=chunks))
        plan = candidate_plans(8)[0 if mode == "none" else -1]
        estimate = estimate_memory(SMALL.instantiate, adamw, workload, plans=[plan])[0]
        assert estimate.step_peak == pytest.approx(bytes_, rel=0.15), (mode, chunks)


def test_auto_picks_the_least_recompute_that_fits(small_estimates):
    total = {describe_setting(e.plan): e.total / GiB for e in small_estimates}
    # Less memory, in this order: none, every 4th block, per-op, every 2nd block, full.
    assert total["none"] > total["every 4th block"] > total["per-op"] > total["every 2nd block"] > total["full"]
    for budget_of, expected in [("none", "none"), ("per-op", "per-op"), ("every 4th block", "per-op"),
                                ("every 2nd block", "every 2nd block"), ("full", "full")]:
        chosen = choose_plan(SMALL.instantiate, adamw, WORKLOAD, total[budget_of] * 1.0001, 8)
        assert describe_setting(chosen.plan) == expected, budget_of


def test_when_nothing_fits_the_error_says_how_much_is_missing_and_what_would_help(small_estimates):
    full = small_estimates[-1].total / GiB
    with pytest.raises(UserError) as info:
        choose_plan(SMALL.instantiate, adamw, WORKLOAD, full * 0.5, 8)
    message = str(info.value)
    assert "\n" not in message
    assert f"even full AC needs an estimated {full:.2f} GiB per process, {full * 0.5:.2f} GiB too many" in message
    for knob in ("batch_size=1", "max_seq_len=256", "2 processes", "optimizer_in_bwd=true", "loss_chunks=8"):
        assert knob in message


def test_what_fits_includes_the_process_s_fixed_cost(small_estimates):
    total = {describe_setting(e.plan): e.total for e in small_estimates}
    budget = total["none"] * 1.0001
    assert describe_setting(choose_plan(SMALL.instantiate, adamw, WORKLOAD, budget / GiB, 8).plan) == "none"
    # The same budget with a process that holds the difference to the full-AC step already: only full AC fits.
    fixed = int(budget - total["full"] * 1.0001)
    chosen = choose_plan(SMALL.instantiate, adamw, WORKLOAD, budget / GiB, 8, fixed)
    assert describe_setting(chosen.plan) == "full" and chosen.fixed == fixed and chosen.device == chosen.total + fixed
    with pytest.raises(UserError, match=r"GiB per process \([0-9.]+ of them the process's own\), "):
        choose_plan(SMALL.instantiate, adamw, WORKLOAD, budget / GiB, 8, int(budget))


def test_the_ablation_adds_each_switch_to_the_ones_before_and_cuda_only_ones_only_on_cuda():
    with torch.device("meta"):
        model = SMALL.instantiate()
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(), model, clip_grad_norm=1.0,
                               optimizer=OptimizerSpec("torch.optim.AdamW"), device="auto")
    workload = WORKLOAD.with_settings(plan.settings, clip_grad_norm=1.0)
    labels = {}
    for device in ("cpu", "cuda"):
        rows = switch_ablation(SMALL.instantiate, adamw, workload, plan.ac, torch.device(device), fixed=5)
        labels[device] = [label for label, _ in rows]
        assert all(e.fixed == 5 for _, e in rows)
    cpu = ["as configured", "+ optimizer._component_=torchao.optim.AdamW8bit (the ao extra)",
           "+ optimizer_in_bwd=true (with clip_grad_norm: null, gradient_accumulation_steps: 1)", "+ loss_chunks=8"]
    assert labels["cpu"] == cpu
    assert labels["cuda"] == cpu + ["+ enable_activation_offloading=true", "+ fsdp.cpu_offload=true"]
    *_, (_, offloaded) = rows
    assert offloaded.parameters == offloaded.optimizer == 0 and offloaded.host > 0  # everything added by then


def test_the_memory_plan_resolves_auto_through_the_planner():
    ac = ACConfig.from_config({"ac_mode": "auto", "ac_memory_budget_gib": 100})
    with torch.device("meta"):
        model = SMALL.instantiate()
    inputs = PlannerInputs(SMALL.instantiate, adamw, WORKLOAD, torch.device("cpu"))
    plan = resolve_memory_plan(ac, MemoryConfig(), model, clip_grad_norm=None, planning=inputs)
    assert plan.ac.mode is ACMode.NONE and plan.budget_gib == 100
    assert "auto -> none (the least recompute that fits: estimated" in dict(plan.describe())["activation checkpointing"]


@pytest.mark.parametrize(
    "values, message",
    [
        ({"ac_mode": "auto", "ac_option": 2}, "ac_option=2: only allowed with ac_mode: selective (ac_mode is auto)"),
        ({"ac_mode": "auto", "enable_activation_checkpointing": False}, "contradicts ac_mode=auto"),
        # Was silently "auto -> none" (a tiny/full YAML, which has the switch on, plus ac_mode=auto).
        ({"ac_mode": "auto", "enable_activation_checkpointing": True},
         "enable_activation_checkpointing=true contradicts ac_mode=auto, which may choose no activation checkpointing"),
        ({"ac_mode": "full", "ac_memory_budget_gib": 20}, "ac_memory_budget_gib=20: only used by ac_mode: auto"),
        ({"ac_mode": "auto", "ac_memory_budget_gib": 0}, "ac_memory_budget_gib=0: must be a positive number"),
        ({"ac_mode": "auto", "ac_memory_budget_gib": True}, "ac_memory_budget_gib=true: must be a positive number"),
    ],
)
def test_auto_keys_are_refused_naming_them(values, message):
    with pytest.raises(ACConfigError) as info:
        ACConfig.from_config(values)
    assert message in str(info.value)


def test_auto_needs_a_budget_on_cpu_and_cannot_be_applied_directly():
    with pytest.raises(UserError, match="ac_mode=auto on cpu: set ac_memory_budget_gib"):
        budget_gib(ACConfig(ac_mode=ACMode.AUTO), torch.device("cpu"))
    with pytest.raises(ACConfigError, match="chosen by the memory planner"):
        setup_activation_checkpointing(SMALL.instantiate(), ac_mode="auto")


def test_the_default_cuda_budget_is_the_free_memory_with_the_fixed_cost_counted_once(monkeypatch):
    """CUDA stood in for: 30 of 80 GiB free when the run starts. Whatever the estimate counts as the process's
    fixed cost (nothing; a context; everything in use, other processes included), what is left for the step is
    the free memory less 10 % of the device; a given budget is taken as it is."""
    free, total = 30 * GiB, 80 * GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    cuda = torch.device("cuda", 0)
    auto = ACConfig(ac_mode=ACMode.AUTO)
    for fixed in (0, GiB // 2, total - free):
        assert budget_gib(auto, cuda, fixed) * GiB - fixed == pytest.approx(free - 0.1 * total, abs=1)
    assert budget_gib(ACConfig(ac_mode=ACMode.AUTO, ac_memory_budget_gib=12), cuda, 5 * GiB) == 12
    with torch.device("meta"):
        model = SMALL.instantiate()
    inputs = PlannerInputs(SMALL.instantiate, adamw, WORKLOAD, cuda, fixed_bytes=total - free)
    plan = resolve_memory_plan(auto, MemoryConfig(), model, clip_grad_norm=None, planning=inputs)
    assert plan.budget_gib == pytest.approx(0.9 * total / GiB)
    assert plan.estimate.device == plan.estimate.total + total - free  # the fixed cost, once, in the estimate


def _full_ac_estimate(args, *, in_bwd: bool, world_size: int):
    from torchtune_ac.models.llama import Llama

    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(optimizer_in_bwd=in_bwd, loss_chunks=4),
                               Llama(args), clip_grad_norm=None, optimizer=OptimizerSpec("torch.optim.AdamW"))
    workload = Workload(batch_size=2, seq_len=64, parallelism=Parallelism(world_size)).with_settings(plan.settings)
    estimate, = estimate_memory(lambda: Llama(args), adamw, workload, [plan.ac])
    return estimate


def test_with_the_step_in_backward_fsdp2_keeps_the_root_s_gradients_whole_until_backward_ends():
    """The switch used to add the root's gradients to the estimate wherever its peak was, at the end of the forward
    too, before any gradient exists: llama3/8B_full in fp32 on 8 processes went from 25.25 to 26.45 GiB with
    optimizer_in_bwd=true. The simulation now keeps them, whole, from when they are computed to the end of backward
    (when FSDP2 reduces them and the optimizer takes them), and counts nothing more: 23.83 GiB."""
    from torchtune_ac.models import LlamaArgs
    from torchtune_ac.models.llama import Llama

    large_vocab = LlamaArgs(vocab_size=4096, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_dim=160,
                            max_seq_len=64)
    root = sum(p.numel() * p.element_size() for name, p in Llama(large_vocab).named_parameters()
               if not name.startswith("layers."))
    sharded = _full_ac_estimate(large_vocab, in_bwd=True, world_size=4)
    assert (sharded.peak_phase, sharded.gradients) == ("rest of backward", root)  # every block's freed at once
    alone = _full_ac_estimate(large_vocab, in_bwd=True, world_size=1)  # no FSDP2: each stepped and freed at once
    assert alone.gradients < root
    small_vocab = dataclasses.replace(large_vocab, vocab_size=96)
    assert (_full_ac_estimate(small_vocab, in_bwd=True, world_size=4).total
            < _full_ac_estimate(small_vocab, in_bwd=False, world_size=4).total)


@pytest.mark.parametrize("world_size, in_bwd, cuda, cpu_offload", [
    (4, True, True, False), (4, True, False, False), (4, False, True, False), (1, True, True, False),
    (4, True, True, True)])
def test_on_a_gpu_under_fsdp2_the_step_in_backward_has_its_temporaries_in_a_pool_of_their_own(world_size, in_bwd,
                                                                                              cuda, cpu_offload):
    """FSDP2 calls the gradient hooks, and so the step in backward, on its reduce-scatter stream, whose pool of the
    caching allocator the default stream's allocations cannot reuse. The plan adds what one parameter's step holds:
    AdamW's simulated step (the CPU's single-tensor path: ``exp_avg_sq.sqrt()`` and its quotient) two temporaries
    of the largest parameter (the output layer, 4096 x 64 fp32), a shard of each on each process. Not on a CPU,
    without FSDP2 (the hooks run on the default stream), with the step after backward, or with CPU offload (the
    step runs on the host)."""
    from torchtune_ac.models import LlamaArgs
    from torchtune_ac.models.llama import Llama

    args = LlamaArgs(vocab_size=4096, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=160,
                     max_seq_len=64)
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(optimizer_in_bwd=in_bwd, loss_chunks=4),
                               Llama(args), clip_grad_norm=None, optimizer=OptimizerSpec("torch.optim.AdamW"))
    transient = []
    for on_gpu in (False, cuda):
        workload = Workload(batch_size=2, seq_len=64, parallelism=Parallelism(world_size), cuda=on_gpu).with_settings(
            plan.settings).with_settings({"cpu_offload": cpu_offload})
        estimate, = estimate_memory(lambda: Llama(args), adamw, workload, [plan.ac])
        transient.append(estimate.transient)
    expected = 2 * 4096 * 64 * 4 // world_size if (world_size > 1 and in_bwd and cuda and not cpu_offload) else 0
    assert transient[1] - transient[0] == expected


def test_packed_grouped_kv_copies_for_varlen_are_counted_only_where_torch_makes_them(monkeypatch):
    """On a torch whose ``varlen_attn`` has no ``enable_gqa=`` (2.11), packed bf16 batches on a GPU copy K and V per
    query head in every layer, and the kernel saves the copies for backward: without AC each block keeps its
    copies, with full AC only the block recomputing holds them. On a torch with ``enable_gqa=`` nothing is added."""
    from torchtune_ac.models import attention
    from torchtune_ac.models.llama import Llama, LlamaArgs
    from torchtune_ac.runtime.dtypes import DType

    args = LlamaArgs(vocab_size=96, dim=64, n_layers=4, n_heads=8, n_kv_heads=2, intermediate_dim=96, max_seq_len=64)
    plans = [ACConfig(ac_mode=mode).resolve(args.n_layers) for mode in (ACMode.NONE, ACMode.FULL)]

    def estimates(varlen: bool):
        workload = Workload(batch_size=2, seq_len=64, dtype=DType.BF16, varlen=varlen)
        return estimate_memory(lambda: Llama(args), adamw, workload, plans)

    copy = 2 * (2 * 64) * (8 - 2) * (64 // 8) * 2  # K and V, tokens, the heads added, head_dim, bf16 bytes
    grouped = {estimate.plan.mode: estimate for estimate in estimates(False)}
    monkeypatch.setattr(attention, "VARLEN_SUPPORT", attention.VarlenSupport(True, True, False))  # torch 2.11's
    assert attention.varlen_kv_copy_bytes(128, 8, 2, 8, torch.bfloat16) == copy
    assert attention.varlen_kv_copy_bytes(128, 8, 8, 8, torch.bfloat16) == 0  # no grouping, no copy
    assert attention.varlen_kv_copy_bytes(128, 8, 2, 8, torch.float32) == 0  # fp32 takes the per-document path
    copied = {estimate.plan.mode: estimate for estimate in estimates(True)}
    assert copied[ACMode.NONE].activations - grouped[ACMode.NONE].activations == copy * args.n_layers
    assert copied[ACMode.FULL].activations == grouped[ACMode.FULL].activations
    for mode in (ACMode.NONE, ACMode.FULL):
        assert copied[mode].transient - grouped[mode].transient == copy
    monkeypatch.setattr(attention, "VARLEN_SUPPORT", attention.VarlenSupport(True, True, True))  # torch 2.12+
    assert [e.total for e in estimates(True)] == [e.total for e in grouped.values()]


@pytest.mark.parametrize("overrides, varlen", [
    (("device=cuda", "dtype=bf16", "dataset.packed=true"), True),
    (("device=cuda", "dtype=bf16", "dataset.packed=false"), False),
    (("device=cuda", "dtype=fp32", "dataset.packed=true"), False),  # fp32 takes the per-document path
    (("device=cpu", "dtype=bf16", "dataset.packed=true"), False),
])
def test_a_packed_bf16_config_for_a_gpu_is_planned_with_varlen_s_copies(overrides, varlen):
    """The planner simulates on a CPU's kernels whatever the run's device: whether the run's attention takes
    varlen_attn follows from the config's device, not from where the simulation runs."""
    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
    from torchtune_ac.run.plan import planner_inputs

    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "tiny/full", list(overrides), [])
    assert planner_inputs(cfg, Parallelism(1), torch.device("cpu")).workload.varlen is varlen


MEASURE_DPO_STEPS = textwrap.dedent("""
    import gc, json, sys, psutil, torch
    from torchtune_ac.config.components import Component
    from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.parallel.fsdp import FSDPConfig
    from torchtune_ac.runtime.dtypes import DType
    from _measure import return_freed_memory_to_os, track_peak_rss
    from torchtune_ac.config.meta_model import build_meta_model
    from torchtune_ac.run.assemble import AssemblyPlan, build_reference, build_training
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.memory.plan import MemoryPlan
    from torchtune_ac.training.dpo import DPOConfig, DPOObjective
    from torchtune_ac.training.step import train_step
    ctx = DistributedContext(0, 1, 0, torch.device("cpu"))
    small = Component(key="model", path="torchtune_ac.models.llama_small")
    tokens = torch.randint(0, 8192, (2, 512))  # one pair: its chosen and its rejected row
    measured = []
    for mode, chunks, resident in json.loads(sys.argv[1]):
        plan = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=mode, ac_option=None, n_layers=8)
        memory = MemoryPlan(ac=plan)
        assembly = AssemblyPlan(DType.FP32, memory)
        reference = (build_reference(build_meta_model(small), assembly, ctx=ctx, checkpoint_dir=None) if resident
                     else None)
        model = build_training(build_meta_model(small), assembly, ctx=ctx).model
        batch = [{"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}]
        if not resident:
            batch[0]["reference_logps"] = torch.zeros(2)
        objective = DPOObjective(DPOConfig(), n_chunks=chunks, reference=reference)
        optimizer = build_optimizer(lambda p: torch.optim.AdamW(p, lr=1e-5), model, in_backward=False)
        train_step(model, optimizer, batch, ctx=ctx, objective=objective)  # allocates the optimizer state
        return_freed_memory_to_os()
        before = psutil.Process().memory_info().rss
        with track_peak_rss() as peak:
            train_step(model, optimizer, batch, ctx=ctx, objective=objective)
        measured.append(peak.peak_bytes - before)
        del model, optimizer, reference, objective
        gc.collect()
    print(json.dumps(measured))
""")
# (ac_mode, loss_chunks, resident reference) measured in one process.
MEASURED_DPO_SETTINGS = [("none", 1, True), ("full", 4, True), ("full", 4, False)]


def test_a_dpo_step_estimate_counts_the_pairs_and_the_reference_and_is_within_15_percent_of_a_measured_step():
    from torchtune_ac.memory.planner import PreferenceStep

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-c", MEASURE_DPO_STEPS, json.dumps(MEASURED_DPO_SETTINGS)],
                            capture_output=True, text=True, env=env, check=True)
    measured = json.loads(result.stdout.split("\n")[-2])
    for (mode, chunks, resident), bytes_ in zip(MEASURED_DPO_SETTINGS, measured):
        workload = Workload(batch_size=1, seq_len=512, settings=MemorySettings(loss_chunks=chunks),
                            preference=PreferenceStep(resident_reference=resident))
        plan = candidate_plans(8)[0 if mode == "none" else -1]
        estimate = estimate_memory(SMALL.instantiate, adamw, workload, plans=[plan])[0]
        # The reference's parameters are resident, as the policy's (neither is part of the step's peak).
        assert estimate.reference == (estimate.parameters if resident else 0)
        assert estimate.total == estimate.step_peak + estimate.parameters + estimate.optimizer + estimate.reference
        assert estimate.step_peak == pytest.approx(bytes_, rel=0.15), (mode, chunks, resident)


def test_a_dpo_step_runs_two_rows_a_pair_and_the_reference_forward():
    from torchtune_ac.memory.planner import PreferenceStep

    plan = candidate_plans(8)[-1]
    pairs = estimate_memory(SMALL.instantiate, adamw, Workload(batch_size=1, seq_len=512,
                                                               preference=PreferenceStep(False)), plans=[plan])[0]
    rows = estimate_memory(SMALL.instantiate, adamw, Workload(batch_size=2, seq_len=512), plans=[plan])[0]
    resident = estimate_memory(SMALL.instantiate, adamw, Workload(batch_size=1, seq_len=512,
                                                                  preference=PreferenceStep(True)), plans=[plan])[0]
    # One pair is two rows: the blocks keep what a batch of two samples keeps. The losses differ by design at
    # loss_chunks 1: DPO's log-probabilities keep the pair's whole float32 logits, where an SFT step's head keeps
    # the output weight's gradient (computed in forward) instead (memory/chunked_loss.py).
    from torchtune_ac.models.families.llama import LLAMA_SMALL

    vocab, dim = LLAMA_SMALL.vocab_size, LLAMA_SMALL.dim
    expected = rows.saved_activations + 2 * 512 * vocab * 4 - vocab * dim * 4
    assert pairs.saved_activations == pytest.approx(expected, rel=0.01)
    # A resident reference runs one more forward (a third of a step's matrix multiplies, without recompute).
    assert resident.flops == pytest.approx(pairs.flops * (1 + 1 / (3 + pairs.extra_flops * 3)), rel=0.05)


def test_ac_mode_auto_chooses_with_the_resident_reference():
    from torchtune_ac.memory.planner import PreferenceStep

    def workload(resident):
        return Workload(batch_size=1, seq_len=512, preference=PreferenceStep(resident_reference=resident))

    precomputed = estimate_memory(SMALL.instantiate, adamw, workload(False), plans=candidate_plans(8)[:1])[0]
    # A budget that holds the step without AC, but not with the reference's parameters as well.
    budget = (precomputed.device + precomputed.parameters / 2) / GiB
    assert choose_plan(SMALL.instantiate, adamw, workload(False), budget, 8).plan.mode is ACMode.NONE
    chosen = choose_plan(SMALL.instantiate, adamw, workload(True), budget, 8)
    assert chosen.plan.mode is not ACMode.NONE and chosen.reference == chosen.parameters


def test_tensor_parallelism_divides_the_step_per_process_but_what_each_rank_keeps_whole():
    """TP 2 on 4 processes against FSDP on 2 (FSDP2 shards over 2 in both): parameters and optimizer state halve;
    the activations halve but for the attention's and the MLP's gathered inputs ([b, s, dim] each, kept by every
    block without AC); the loss (loss_chunks: 1, the targets' logits through the head) computes on vocabulary
    shards, nothing of it whole."""
    from torchtune_ac.models import LlamaArgs
    from torchtune_ac.models.llama import Llama

    args = LlamaArgs(vocab_size=4096, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_dim=160,
                     max_seq_len=64)
    plans = candidate_plans(args.n_layers)
    none, full = plans[0], plans[-1]
    fsdp = Workload(batch_size=2, seq_len=64, parallelism=Parallelism(2))
    tp = dataclasses.replace(fsdp, parallelism=Parallelism(4, tensor=2))
    alone, split = (estimate_memory(lambda: Llama(args), adamw, workload, [none, full]) for workload in (fsdp, tp))
    block_input = 2 * 64 * args.dim * 4  # [b, s, dim] in fp32
    batch = 2 * (2 * 64 * 8) + 8  # tokens, labels (int64) and the target count
    for ours, theirs in zip(split, alone):
        assert abs(2 * ours.parameters - theirs.parameters) <= 2
        assert abs(2 * ours.optimizer - theirs.optimizer) <= 2
        assert ours.peak_phase == theirs.peak_phase
        # the running block's two gathered inputs, half of them beyond its share
        whole = block_input
        assert abs(ours.transient - ((theirs.transient - batch) / 2 + batch + whole)) <= 2
    # without AC every block keeps its gathered inputs; with full AC each keeps only its split input
    assert abs(split[0].activations - (alone[0].activations / 2 + args.n_layers * block_input)) <= 1
    assert abs(split[1].activations - alone[1].activations / 2) <= 1


@pytest.mark.parametrize("args, world_size, expected", [
    ("LLAMA_TINY", 8, 2),  # 2 key/value heads
    ("LLAMA3_1_70B", 16, 8),  # within a node of 8 GPUs
    ("LLAMA3_1_70B", 4, 4),
    ("GEMMA3_1B", 8, None),  # 1 key/value head: no degree splits it
])
def test_the_suggested_tensor_parallel_degree_is_the_largest_the_model_and_a_node_allow(args, world_size, expected):
    from torchtune_ac.memory.planner import suggested_tensor_parallel_degree
    from torchtune_ac.models.families import gemma3, llama

    built = {"LLAMA_TINY": (llama.FAMILY, llama.LLAMA_TINY), "LLAMA3_1_70B": (llama.FAMILY, llama.LLAMA3_1_70B),
             "GEMMA3_1B": (gemma3.FAMILY, gemma3.GEMMA3_1B)}[args]
    with torch.device("meta"):
        model = built[0].build(built[1])
    assert suggested_tensor_parallel_degree(model, world_size) == expected
