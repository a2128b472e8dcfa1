"""Expert parallelism: the degrees it refuses, the mesh ``(replicate, expert_shard, ep)``, and training on gloo
ranks against one process.

The distributed tests train tiny mixtures of experts of both families (Qwen3-MoE: softmax router, experts stored
``[E, out, in]``; gpt-oss: router and expert biases, ``[E, in, out]`` interleaved, the clamped SwiGLU, sinks) for 3
steps with each MoE layer's experts split over the ``ep`` dimension, and compare every step's loss and gradient
norm with one process training the same model from the same weights on the same global batch: equal within the
rounding of a step (``numerics.assert_steps_alike``: the gradients of an expert are summed from every process's
tokens in another order). Between them the cases cover every AC mode, the whole-logits and the chunked loss, packed
batches, the step in backward, clipping, compile and 8-bit optimizer state; on 4 ranks, EP 2 x FSDP2 2 and HSDP.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import parallel_testlib
from compile_testlib import compile_blocks_counted, graphs_and_breaks
from gloo_testlib import run_on_gloo_ranks
from numerics import assert_all_close, assert_close, llama_terms
from parallel_testlib import CPU, LENGTH, assert_trains_as_one_process, batch, rows
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
from torchtune_ac.activation_checkpointing.mechanism import apply_ac_plan
from torchtune_ac.errors import UserError
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.models.families.gpt_oss import FAMILY as GPT_OSS
from torchtune_ac.models.families.gpt_oss import GPT_OSS_20B
from torchtune_ac.models.families.llama import FAMILY as LLAMA
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.models.families.qwen3_moe import FAMILY as QWEN3_MOE
from torchtune_ac.models.families.qwen3_moe import QWEN3_MOE_TINY
from torchtune_ac.models.family import ModelFamily
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.models.moe import MoE
from torchtune_ac.parallel.expert_parallel import apply_expert_parallel
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.run.plan import resolve_parallelism
from torchtune_ac.run.weights import initialize_weights_
from torchtune_ac.runtime.parallelism import EP_DIM, Parallelism

_SMALL = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64)
TINY = {
    # Both layers sparse, 4 experts of 32, 2 per token, without the load-balancing loss (each process's own is
    # not one process's over the whole batch: docs/moe.md).
    "qwen3_moe": dataclasses.replace(
        QWEN3_MOE_TINY, **_SMALL, intermediate_dim=128,
        moe=dataclasses.replace(QWEN3_MOE_TINY.moe, num_experts=4, expert_dim=32, dense_layers=(), aux_loss=False)),
    # A sliding layer (8 tokens) then a full one, sinks, YaRN, biased router and experts.
    "gpt_oss": dataclasses.replace(
        GPT_OSS_20B, **_SMALL, intermediate_dim=32, sliding_window=8,
        layer_types=("sliding_attention", "full_attention"),
        moe=dataclasses.replace(GPT_OSS_20B.moe, num_experts=4, top_k=2, expert_dim=32)),
}
FAMILIES = {"qwen3_moe": QWEN3_MOE, "gpt_oss": GPT_OSS}


# ---------------------------------------------------------------------------------------------------------------
# The degrees and the mesh
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world, replicate, expert, shape", [
    (2, 1, 2, {"expert_shard": 1, "ep": 2}),
    (8, 1, 2, {"expert_shard": 4, "ep": 2}),
    (8, 2, 4, {"replicate": 2, "expert_shard": 1, "ep": 4}),
])
def test_the_mesh_splits_the_shard_dimension(world, replicate, expert, shape) -> None:
    parallelism = Parallelism(world, replicate=replicate, expert=expert)
    assert parallelism.mesh_shape == shape
    assert parallelism.shard == world // replicate and parallelism.expert_shard == world // replicate // expert
    # Expert parallelism does not change how the data is split: every process reads its own share.
    assert parallelism.data_parallel_size == world and parallelism.data_parallel_rank(3) == 3


@pytest.mark.parametrize("world, replicate, expert, tensor, message", [
    (4, 1, 3, 1, "expert_parallel_dim=3: must divide the processes each replica shards over (world size 4 / "
                 "fsdp.replicate_degree 1 = 4)"),
    (4, 2, 4, 1, "expert_parallel_dim=4: must divide the processes each replica shards over (world size 4 / "
                 "fsdp.replicate_degree 2 = 2)"),
    (4, 1, 2, 2, "expert_parallel_dim=2 with tensor_parallel_dim=2: a mixture of experts does not run under tensor "
                 "parallelism; use tensor_parallel_dim: 1"),
    (4, 1, 0, 1, "expert_parallel_dim=0: must be at least 1"),
])
def test_a_degree_the_world_cannot_be_split_by_is_refused_in_one_line(world, replicate, expert, tensor,
                                                                      message) -> None:
    with pytest.raises(UserError) as error:
        Parallelism(world, replicate=replicate, tensor=tensor, expert=expert)
    assert str(error.value) == message


def _config(**keys: Any) -> SimpleNamespace:
    """The keys ``resolve_parallelism`` reads."""
    return SimpleNamespace(**{"fsdp": FSDPConfig(), "tensor_parallel_dim": 1, "expert_parallel_dim": 1,
                              "max_seq_len": 64, **keys})


@pytest.mark.parametrize("model, keys, message", [
    ("qwen3_moe", {"expert_parallel_dim": 3}, "expert_parallel_dim=3: must divide the model's 4 experts a layer (each "
                                              "process of a group holds as many)"),
    ("llama", {"expert_parallel_dim": 2}, "expert_parallel_dim=2: the model has no mixture-of-experts layers to "
                                          "split; use expert_parallel_dim: 1"),
    ("qwen3_moe", {"tensor_parallel_dim": 2}, "tensor_parallel_dim=2: a mixture of experts (4 experts a layer) does "
                                              "not run under tensor parallelism; use tensor_parallel_dim: 1, and "
                                              "expert_parallel_dim to split its experts"),
])
def test_a_degree_the_model_cannot_be_split_by_is_refused_in_one_line(model, keys, message) -> None:
    family, args = (LLAMA, LLAMA_TINY) if model == "llama" else (FAMILIES[model], TINY[model])
    with torch.device("meta"):
        built = family.build(args)
    with pytest.raises(UserError) as error:
        resolve_parallelism(_config(**keys), built, world_size=6)
    assert str(error.value) == message


# ---------------------------------------------------------------------------------------------------------------
# Training on gloo ranks against one process
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case(parallel_testlib.Case):
    """One training run of a tiny mixture of experts (a key of ``TINY``)."""

    @property
    def args(self) -> LlamaArgs:
        return TINY[self.model]

    @property
    def family(self) -> ModelFamily:
        return FAMILIES[self.model]


def _check_split(model: nn.Module, case: Case, mesh) -> None:
    """Each MoE layer's experts: this rank's share of the expert dimension, sharded over ``ep`` (and by FSDP2 over
    ``expert_shard``); the dense layers over every process."""
    ep = mesh[EP_DIM].size()
    layer = next(m for m in model.modules() if isinstance(m, MoE))
    weight = layer.experts.gate_up_proj
    assert isinstance(weight, DTensor) and weight.shape[0] == case.args.moe.num_experts
    assert weight.placements[-1] == Shard(0) and weight.device_mesh.mesh_dim_names[-1] == EP_DIM
    replicas = mesh["replicate"].size() if "replicate" in mesh.mesh_dim_names else 1
    assert weight.device_mesh.size() == mesh.size()  # (replicate,) expert_shard, ep
    # This rank's experts: a share over ep, sharded again over expert_shard, whole over the replicas.
    assert weight.to_local().shape[0] == case.args.moe.num_experts // (mesh.size() // replicas)
    assert layer.experts.exchange is not None and layer.experts.exchange.degree == ep
    assert "ep" not in model.tok_embeddings.weight.device_mesh.mesh_dim_names


def check_against_one_process(rank: int, world_size: int,
                              runs: tuple[tuple[tuple[int, int], tuple[Case, ...]], ...]) -> None:
    """Each run's cases trained on its layout ``(replicate, expert)`` and by this process alone, compared step by
    step."""
    if any(case.optimizer == "adamw8bit" for _, cases in runs for case in cases):
        # torchao compiles its update per parameter shape (minutes on a CPU): eagerly here, the same arithmetic.
        torch.compile = lambda function=None, **options: function
    for (replicate, expert), cases in runs:
        parallelism = Parallelism(world_size, replicate=replicate, expert=expert)
        mesh = parallelism.build_mesh("cpu")
        for case in cases:
            # Expert parallelism does not change how the data is split: every process reads its own rows.
            assert_trains_as_one_process(case, rank, world_size, parallelism, mesh, dp_rank=rank, dp_degree=world_size,
                                         check_split=lambda model: _check_split(model, case, mesh))


TWO_RANK_CASES = (
    # Qwen3-MoE: no AC, the targets' logits in one chunk; per-op AC on packed rows with the chunked loss; full AC
    # with the step in backward; compiled blocks under per-op AC (the exchange inside their graphs); 8-bit optimizer
    # state.
    Case("qwen3_moe"),
    Case("qwen3_moe", packed=True, loss_chunks=2, ac_mode="selective", ac_option="op"),
    Case("qwen3_moe", ac_mode="full", in_backward=True),
    Case("qwen3_moe", compile=True, ac_mode="selective", ac_option="op"),
    Case("qwen3_moe", optimizer="adamw8bit"),
    # gpt-oss: biased experts (their biases split with them), sinks and a sliding window within packed documents,
    # every 2nd block checkpointed.
    Case("gpt_oss", packed=True, ac_mode="selective", ac_option=2),
)


@pytest.mark.distributed
def test_two_ranks_of_expert_parallelism_train_as_one_process(tmp_path: Path) -> None:
    """EP 2 (the experts of each layer split over the 2 ranks, FSDP2 over 2 for the dense layers)."""
    run_on_gloo_ranks(check_against_one_process, 2, (((1, 2), TWO_RANK_CASES),), store_dir=tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_ep_with_fsdp_and_hsdp_on_4_ranks_trains_as_one_process(tmp_path: Path) -> None:
    """4 ranks: EP 2 x FSDP2 2 (each expert sharded over the 2 ranks that hold it), then HSDP (2 replicas of
    EP 2)."""
    runs = (((1, 2), (Case("qwen3_moe", packed=True, loss_chunks=2, ac_mode="selective", ac_option="op"),)),
            ((2, 2), (Case("gpt_oss", in_backward=True),)))
    run_on_gloo_ranks(check_against_one_process, 4, runs, store_dir=tmp_path, world_size=4)


def _expert_parallel_model(case: Case, mesh, compiled: bool = False) -> nn.Module:
    """``case``'s model on this rank as a run assembles it without FSDP2: AC, compile, EP 2 (``ep``), weights."""
    with torch.device("meta"):
        model = QWEN3_MOE.build(case.args)
    apply_ac_plan(model, resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=case.ac_mode,
                                         ac_option=case.ac_option, n_layers=len(transformer_blocks(model))))
    compile_blocks_counted(model, compiled)
    apply_expert_parallel(model, mesh[EP_DIM])
    model.to_empty(device=CPU)
    initialize_weights_(model, None, dtype=torch.float32, seed=7, sharded=True)
    return model


# The exchange's all-to-alls: the counts' (a functional collective) and the rows' (our op, ``all_to_all_rows``).
ALL_TO_ALLS = ("_c10d_functional::all_to_all_single", "torchtune_ac::all_to_all_rows")


class _AllToAllsIssued(TorchDispatchMode):
    """Counts the all-to-alls issued; a result that per-op AC's recompute takes from its cache is never issued,
    so never reaches this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() in ALL_TO_ALLS:
            self.counts["all_to_all"] += 1
        return func(*args, **(kwargs or {}))


def check_backward_all_to_alls(rank: int, world_size: int) -> None:
    """The all-to-alls each AC mode's backward issues under EP 2 (no FSDP2)."""
    mesh = Parallelism(world_size, expert=2).build_mesh("cpu")
    issued = {}
    for mode, option in (("none", None), ("selective", "op"), ("full", None)):
        case = Case("qwen3_moe", ac_mode=mode, ac_option=option)
        model = _expert_parallel_model(case, mesh)
        loss = model(rows(batch(case, 0), rank * 2, 2)["tokens"]).float().square().mean()
        with _AllToAllsIssued() as counter:
            loss.backward()
        issued[mode] = counter.counts["all_to_all"]
    # Backward's own: the gradients of the rows sent back along both exchanges of each MoE layer (2 x 2 layers).
    # Every mode issues exactly these: per-op AC saves the forward's, and full AC keeps the exchange's outputs in
    # MoE blocks too (it once recomputed the forward's three of each layer as well).
    assert issued == {"none": 4, "selective": 4, "full": 4}, issued


@pytest.mark.distributed
def test_per_op_ac_does_not_repeat_the_all_to_alls_in_backward(tmp_path: Path) -> None:
    """Per-op AC keeps the all-to-alls' outputs: its recompute under EP 2 sends no token again."""
    run_on_gloo_ranks(check_backward_all_to_alls, 2, store_dir=tmp_path)


def check_compiled_blocks_against_eager(rank: int, world_size: int) -> None:
    """Each AC mode's blocks compiled under EP 2: graphs and breaks counted, loss and gradients against eager's."""
    mesh = Parallelism(world_size, expert=2).build_mesh("cpu")
    for mode, option in (("none", None), ("selective", "op"), ("full", None)):
        case = Case("qwen3_moe", ac_mode=mode, ac_option=option)
        tokens = rows(batch(case, 0), rank * 2, 2)["tokens"]
        results = {}
        for compiled in (False, True):
            model = _expert_parallel_model(case, mesh, compiled)
            loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
            grads = {name: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                     for name, p in model.named_parameters()}
            results[compiled] = (loss.detach(), grads)
        # Both blocks are MoE blocks of one shape: one graph, the exchange inside it.
        assert graphs_and_breaks() == (1, {}), (mode, graphs_and_breaks())
        # Dynamo's graphs run the same kernels, some fused or reordered by AOT autograd's decompositions: within
        # the rounding of a step.
        terms = llama_terms(case.args, LENGTH, 2 * LENGTH)
        assert_close(results[True][0], results[False][0], terms=terms, what=f"{mode}: loss")
        assert_all_close(results[True][1], results[False][1], terms=terms, what=f"{mode}: gradient")


@pytest.mark.distributed
def test_moe_blocks_compile_under_expert_parallelism_without_graph_breaks(tmp_path: Path) -> None:
    """EP 2 on 2 gloo ranks, ``ac_mode`` none, per-op and full: each compiled MoE block is one graph with its
    exchange inside (the rows' all-to-all an op with a shape function), no graph break, and the loss and every
    gradient are eager's within rounding."""
    run_on_gloo_ranks(check_compiled_blocks_against_eager, 2, store_dir=tmp_path)


# moe_expert_tokens (per layer, rows per expert) and the EP degree -> each layer's busiest process against the mean.
RANK_LOADS = [
    ([[4, 4, 4, 4]], 2, [1.0]),  # balanced
    ([[3, 2, 1, 2], [0, 0, 1, 3]], 2, [1.25, 2.0]),  # 5 of 8 rows on process 0; all 4 on process 1
    ([[1, 2, 3, 6]], 4, [2.0]),  # 6 of 12 on process 3, the mean 3
    ([[0, 0]], 2, [1.0]),  # no rows: balanced
]


@pytest.mark.parametrize("expert_tokens, degree, expected", RANK_LOADS)
def test_the_busiest_rank_load_against_the_mean(expert_tokens, degree, expected):
    from torchtune_ac.parallel.expert_parallel import busiest_rank_load

    assert busiest_rank_load(expert_tokens, degree) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("mode, option", [("none", None), ("selective", "op"), ("full", None)])
def test_no_ac_mode_sends_the_tokens_again_in_backward(mode, option):
    """EP on a world of one (each all-to-all sends to itself), a tiny Qwen3-MoE of 3 MoE layers: forward runs 3
    all-to-alls a layer (the counts, the rows out, the rows back); backward runs the rows' gradients' 2 a layer and
    nothing more under every AC mode: per-op AC and full AC keep the all-to-alls' outputs (full AC recomputed the
    block's exchange before, 5 a layer in backward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtune_ac.activation_checkpointing.mechanism import ACMode, ac_plan, apply_ac_plan
    from torchtune_ac.models import qwen3_moe_tiny
    from torchtune_ac.parallel.expert_parallel import apply_expert_parallel

    class CountAllToAlls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.name() in ALL_TO_ALLS
            return func(*args, **(kwargs or {}))

    # apply_expert_parallel turns a Dynamo switch on for the whole process: given back as it was.
    switch = torch._dynamo.config.capture_dynamic_output_shape_ops
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = qwen3_moe_tiny()
        model.init_weights()
        apply_ac_plan(model, ac_plan(ACMode(mode), option, len(model.layers)))
        apply_expert_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("ep",)))
        with CountAllToAlls() as forward:
            logits = model(torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0)))
        with CountAllToAlls() as backward:
            logits.float().square().mean().backward()
    finally:
        torch.distributed.destroy_process_group()
        torch._dynamo.config.capture_dynamic_output_shape_ops = switch
    moe_layers = 3
    assert (forward.count, backward.count) == (3 * moe_layers, 2 * moe_layers)
