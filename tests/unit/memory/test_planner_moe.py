"""The memory planner on a mixture of experts under expert parallelism: the simulated all-to-alls hold what the real
ones hold, parameters, gradients and optimizer state are the whole model's over every process whatever the
expert-parallel degree, FSDP2 gathers only a process's own experts, the routed rows carry the stated margin, and
``tune plan`` says so."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import time
import weakref
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from torchtune_ac.activation_checkpointing.mechanism import save_matmuls_and_attention
from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
from torchtune_ac.memory.planner import (ROUTED_ROWS_MARGIN, MemoryEstimate, Workload, candidate_plans,
                                         estimate_memory)
from torchtune_ac.memory.planner.experts import SimulatedExpertExchange
from torchtune_ac.memory.planner.simulation import _LiveStorages, _simulate
from torchtune_ac.models.families.qwen3_moe import QWEN3_MOE_TINY
from torchtune_ac.models.llama import Llama
from torchtune_ac.models.moe import MoE, MoEArgs, grouped_mm
from torchtune_ac.parallel.expert_parallel import ExpertAllToAll
from torchtune_ac.runtime.parallelism import Parallelism

# Two sparse layers (simulated whole, no extrapolation) of 8 experts, whose experts outweigh the rest of a block.
ARGS = dataclasses.replace(QWEN3_MOE_TINY, n_layers=2,
                           moe=dataclasses.replace(QWEN3_MOE_TINY.moe, dense_layers=(), aux_loss=False))
WORLD = 4


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-5)


def _workload(expert: int, margin: float = 1.0, world: int = WORLD) -> Workload:
    return Workload(batch_size=2, seq_len=64, parallelism=Parallelism(world, expert=expert),
                    routed_rows_margin=margin)


@functools.lru_cache(maxsize=None)  # the estimates are values; several tests ask for the same ones
def _estimate(expert: int, mode: str = "full", margin: float = 1.0, world: int = WORLD):
    plan = {p.mode.value: p for p in candidate_plans(ARGS.n_layers)}[mode]
    return estimate_memory(lambda: Llama(ARGS), adamw, _workload(expert, margin, world), [plan])[0]


@functools.lru_cache(maxsize=None)
def _full_ac_step(expert: int):
    """The simulated step with full AC on ``WORLD`` processes (the whole model: no extrapolation)."""
    return _simulate(lambda: Llama(ARGS), adamw, "full", None, None, _workload(expert))


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


# ------------------------------------------------------------------------- the exchange against the real one


class _RealStorages(TorchDispatchMode):
    """The bytes of real memory the ops allocate (storages of plain tensors, by address), now and at the most. The
    functional collectives' ``AsyncCollectiveTensor`` wraps its result without memory of its own: not counted."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in known}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if type(leaf) is torch.Tensor and leaf.untyped_storage().nbytes() > 0:
                storage = leaf.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and key not in self.known:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _settled(read: Callable[[], int], tries: int = 100) -> int:
    """``read()`` once it holds still over a short sleep: what waits for the cycle collector (its timing follows the
    tests run before in the process), or for gloo's worker thread, which lets go of an all-to-all's buffers a moment
    after the op has returned (later under load: a race seen once in CI, one ``[2000, 96]`` buffer), is not kept for
    backward. A storage the forward really keeps never goes, so the test still sees it."""
    value = read()
    for _ in range(tries):
        gc.collect()
        time.sleep(0.02)  # the worker thread runs while this one sleeps
        now, value = value, read()
        if now == value:
            break
    return value


def _layer_memory(exchange, *, fake: bool, per_op: bool) -> tuple[float, float]:
    """(bytes kept for backward by one MoE layer's forward, the most held at once through forward and backward),
    on fake tensors as the planner counts them or on real ones."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(0)
        layer = MoE(96, MoEArgs(num_experts=8, top_k=2, expert_dim=40))
        for param in layer.parameters():
            torch.nn.init.normal_(param, std=0.02)
        layer.experts.exchange = exchange
        x = torch.randn(1000, 96, requires_grad=True)
        if fake:
            tracker = _LiveStorages(1, set())
            tracker.known = {t.untyped_storage()._cdata for t in [*layer.parameters(), x]}
        else:
            tracker = _RealStorages([*layer.parameters(), x])
        context = lambda: create_selective_checkpoint_contexts(save_matmuls_and_attention)  # noqa: E731
        with tracker:
            y = (checkpoint(layer, x, use_reentrant=False, context_fn=context) if per_op else layer(x))[0]
            saved = tracker.mark_activations() if fake else _settled(lambda: tracker.now)
            y.sum().backward()
        return saved, tracker.peaks["forward"].value if fake else tracker.peak


@pytest.mark.parametrize("per_op", [False, True])
def test_the_simulated_exchange_holds_what_the_real_all_to_alls_hold(world_of_one, per_op):
    """``ExpertAllToAll`` on a world of one (its rows sent to itself, all of them received: a balanced router's
    share) against the planner's exchange at margin 1, one layer, no AC and per-op AC (which saves the all-to-alls'
    outputs): the bytes the forward keeps and the peak of forward and backward agree to the few bytes of the grouped
    matmul's offsets; the exchange adds its buffers to the peak, and under per-op AC its outputs to what the forward
    keeps (a real layer with and without it differs by far more)."""
    real = _layer_memory(ExpertAllToAll(world_of_one, 1), fake=False, per_op=per_op)
    simulated = _layer_memory(SimulatedExpertExchange(1, 1.0), fake=True, per_op=per_op)
    without = _layer_memory(None, fake=False, per_op=per_op)
    for measured, planned in zip(real, simulated):
        assert abs(measured - planned) <= 256
    buffer = 1000 * 2 * 96 * 4  # the routed rows, [N, dim] in float32
    assert real[1] - without[1] >= buffer // 2  # the peak holds the exchange's buffers
    if per_op:
        assert real[0] - without[0] >= buffer  # per-op AC keeps both all-to-alls' outputs


def test_the_planner_s_grouped_matmul_holds_what_the_real_one_holds_in_bf16():
    """On fake bfloat16 tensors ``grouped_mm`` runs ``torch._grouped_mm`` itself: forward and backward peak as on
    real tensors (a slice of the first expert's weight would hold a zeroed whole weight more in backward), and its
    FLOPs are counted: the forward and the two products of backward, 2 N K M each."""
    experts, k, m, n = 8, 64, 96, 1000
    peaks, flops = [], 0
    for fake in (False, True):
        with FakeTensorMode() if fake else contextlib.nullcontext():
            weight = torch.nn.Parameter(torch.randn(experts, m, k, dtype=torch.bfloat16))  # [E, out, in]
            x = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
            counts = torch.full((experts,), n // experts, dtype=torch.long)
            if fake:
                tracker = _LiveStorages(1, set())
                tracker.known = {t.untyped_storage()._cdata for t in [weight, x, counts]}
            else:
                tracker = _RealStorages([weight, x, counts])
            with tracker:
                grouped_mm(x, weight.transpose(1, 2), counts).backward(torch.ones(n, m, dtype=torch.bfloat16))
            peaks.append(tracker.peaks["forward"].value if fake else tracker.peak)
            flops = tracker.flops if fake else flops
    assert peaks[1] == peaks[0]
    assert flops == 3 * 2 * n * k * m


# -------------------------------------------------------------------------------------- the state per process


@pytest.mark.parametrize("expert", [2, 4])
def test_parameters_gradients_and_optimizer_state_are_the_whole_model_over_every_process(expert):
    """EP x FSDP: a process holds E / ep experts of each layer, sharded over shard / ep processes: 1 / shard of the
    whole model, as without expert parallelism, for its parameters, its optimizer state and its gradients."""
    whole = _bytes(Llama(ARGS).parameters())
    alone, split = _estimate(1), _estimate(expert)
    assert split.parameters == alone.parameters == math.ceil(whole / WORLD)
    assert split.optimizer == alone.optimizer  # AdamW's two states of every parameter, and its step counters
    assert alone.optimizer == math.ceil((2 * whole + 4 * len(list(Llama(ARGS).parameters()))) / WORLD)
    after_backward = [_full_ac_step(ep).peaks["optimizer step"] for ep in (1, expert)]
    assert after_backward[1].grads == pytest.approx(after_backward[0].grads, rel=1e-12)
    assert after_backward[0].grads == pytest.approx(whole / WORLD, rel=1e-12)


def test_an_expert_s_optimizer_temporaries_are_told_by_what_they_were_computed_from_not_their_shape():
    """In the optimizer step, what is computed from an expert's parameter, gradient or state (and from that) is the
    expert's, sharded over ``expert_shard``; a dense parameter of the same shape is not; a list op's i-th output is
    its lists' i-th tensors'."""
    expert, dense = torch.ones(2, 8), torch.ones(2, 8)
    tracker = _LiveStorages(4, set(), expert_parameters=[expert], expert_shard_degree=1)
    tracker.known = {expert.untyped_storage()._cdata, dense.untyped_storage()._cdata}
    tracker.in_optimizer = True
    with tracker:
        from_expert, from_dense = expert.sqrt(), dense.sqrt()
        from_temporary = from_expert / 2  # computed from an expert's temporary
        listed = torch._foreach_mul([dense, expert], 2.0)
    outputs = {"expert": from_expert, "dense": from_dense, "temporary": from_temporary,
               "listed dense": listed[0], "listed expert": listed[1]}
    keys = {name: t.untyped_storage()._cdata for name, t in outputs.items()}
    assert {name for name, key in keys.items() if key in tracker.expert_temporaries} == {
        "expert", "temporary", "listed expert"}
    assert tracker._expert_opt == 3 * expert.untyped_storage().nbytes()


def test_the_step_in_backward_s_pool_on_a_gpu_holds_an_expert_s_temporaries_as_its_shard():
    """On a GPU under FSDP2 the step in backward's temporaries have a pool of their own (``in_backward_stream_pool``):
    the most one parameter's step holds, on its shard. With EP 4 of 4 processes a process's experts are not
    sharded further (``expert_shard`` 1): AdamW's two temporaries of its gate and up projections (2 of the 8 experts,
    [2, 128, 128] in fp32) whole, more than the output layer's on a quarter of it."""
    from torchtune_ac.activation_checkpointing.config import ACConfig
    from torchtune_ac.activation_checkpointing.mechanism import ACMode
    from torchtune_ac.memory.feature import OptimizerSpec
    from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan

    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(optimizer_in_bwd=True, loss_chunks=4),
                               Llama(ARGS), clip_grad_norm=None, optimizer=OptimizerSpec("torch.optim.AdamW"))
    transient = []
    for cuda in (False, True):
        workload = dataclasses.replace(_workload(4), cuda=cuda).with_settings(plan.settings)
        transient.append(estimate_memory(lambda: Llama(ARGS), adamw, workload, [plan.ac])[0].transient)
    gate_up = 2 * 2 * ARGS.moe.expert_dim * ARGS.dim * 4  # this process's 2 experts' [2 * expert_dim, dim]
    assert 2 * gate_up > 2 * ARGS.vocab_size * ARGS.dim * 4 // WORLD
    assert transient[1] - transient[0] == 2 * gate_up


# ---------------------------------------------------------------------------------- FSDP2's gathered experts


def _fsdp_part(expert: int):
    """The estimate's FSDP2 share of its transient (gathered parameters and the reduce-scatter input): its
    transient less the simulated step's temporaries at the peak and the batch."""
    estimate = _estimate(expert)
    simulation = _full_ac_step(expert)
    return estimate.transient - simulation.peaks[estimate.peak_phase].other - simulation.batch


@pytest.mark.parametrize("expert", [2, 4])
def test_fsdp2_gathers_only_this_process_s_experts(expert):
    """Without expert parallelism a block's all-gather holds every expert of its layer (two blocks: the running
    one and the prefetched one); with it, a process's E / ep, in a group of their own (counted whole: FSDP2 copies
    its own shard into the gathered tensor too), and the largest reduce-scatter input is the largest group's."""
    model = Llama(ARGS)
    experts = _bytes(model.layers[0].mlp.experts.parameters())
    block = _bytes(model.layers[0].parameters())
    dense = block - experts
    root = _bytes([p for name, p in model.named_parameters() if not name.startswith("layers.")])
    outer = _bytes([*model.norm.parameters(), *model.output.parameters()])  # the largest group outside the blocks
    n = WORLD
    without = (root + 2 * block) * (n - 1) / n + max(block, outer)
    with_ep = (root + 2 * dense) * (n - 1) / n + 2 * experts / expert + max(dense, experts / expert, outer)
    assert _fsdp_part(1) == pytest.approx(without, abs=1)
    assert _fsdp_part(expert) == pytest.approx(with_ep, abs=1)
    # Where expert parallelism saves memory: the experts' gathered bytes (and the reduce buffer) of two blocks.
    assert _estimate(expert).transient < _estimate(1).transient
    assert without - with_ep >= 2 * experts * ((n - 1) / n - 1 / expert)


# ------------------------------------------------------------------------------------------- the routed rows


def test_the_routed_rows_margin_sizes_what_a_process_s_experts_compute():
    """Under expert parallelism the experts of a process compute ``margin`` times a balanced router's rows: what a
    forward keeps grows in step with the margin (each further half of the balanced share adds the same bytes, at
    least the rows and their outputs for every MoE layer); without expert parallelism there is no margin."""
    saved = {margin: _estimate(2, "none", margin, world=2).saved_activations for margin in (1.0, 1.5, 2.0)}
    step = saved[1.5] - saved[1.0]
    assert saved[2.0] - saved[1.5] == step
    rows = 2 * 64 * ARGS.moe.top_k // 2  # half the balanced share: the tokens' k copies, halved
    assert step >= ARGS.n_layers * rows * 2 * ARGS.dim * 4
    assert _estimate(1, "none", 1.0).saved_activations == _estimate(1, "none", 2.0).saved_activations
    assert ROUTED_ROWS_MARGIN == 1.5  # what the docs and the table say


def _assumptions(monkeypatch, *overrides: str) -> str:
    """``tune plan``'s assumptions line for the tiny MoE on 2 processes (its estimates stubbed: only the line is
    asked of it)."""
    from torchtune_ac.run import memory_table as table

    def estimates(build_model, make_optimizer, workload, plans):
        return [MemoryEstimate(plan, 0, 0, 0, 0, 0, 0, 0.0, "forward", 1.0) for plan in plans]

    monkeypatch.setattr(table, "estimate_memory", estimates)
    monkeypatch.setattr(table, "switch_ablation", lambda *args, **kwargs: ())
    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "tiny/moe", list(overrides), [])
    lines = table.memory_table(cfg, world_size=2, budget_gib=None).lines()
    return next(line for line in lines if line.startswith("Assumptions:"))


def test_tune_plan_states_the_margin_under_expert_parallelism(monkeypatch):
    assert ("; under expert parallelism each process's experts receive 1.5x the rows a balanced router sends them "
            "(its own tokens' 2 copies") in _assumptions(monkeypatch, "expert_parallel_dim=2")
    assert ("; each process's experts compute its own tokens' 2 copies (top_k), whatever the router does"
            in _assumptions(monkeypatch))


@pytest.mark.parametrize("device, dtype, capability, says", [
    ("cpu", torch.float32, None, "is torch's grouped matmul, the one a CPU run takes"),
    ("cuda", torch.bfloat16, (9, 0), "is torch's grouped matmul, the one this machine's GPU (compute capability "
                                     "9.0) takes"),
    ("cuda", torch.bfloat16, (8, 0), "is torch's grouped matmul, but this machine's GPU (compute capability 8.0) "
                                     "takes the padded batched matmul (grouped needs bf16 on compute capability 9.x "
                                     "or 10.x): its buffers, rows padded to the busiest expert, are not counted"),
    ("cuda", torch.bfloat16, (12, 0), "but this machine's GPU (compute capability 12.0) takes the padded"),
    ("cuda", torch.float32, None, "is torch's grouped matmul, but a GPU in float32 takes the padded batched matmul"),
    ("cuda", torch.bfloat16, None, "is torch's grouped matmul, which a GPU of compute capability 9.x or 10.x (H100, "
                                   "H200, B200) takes in bf16; any other GPU takes the padded batched matmul, whose "
                                   "buffers (rows padded to the busiest expert) are not counted"),
])
def test_tune_plan_says_which_experts_kernel_it_charges_and_which_the_run_s_gpu_takes(monkeypatch, device, dtype,
                                                                                       capability, says):
    from torchtune_ac.run.memory_table import expert_kernel_charged

    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    with torch.device("meta"):
        model = Llama(ARGS)
    assert says in expert_kernel_charged(model, dtype, torch.device(device))
