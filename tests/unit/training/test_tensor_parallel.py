"""Tensor and sequence parallelism: each family's plan (pure data), the degrees it refuses, the mesh
``(replicate, shard, tp)``, and training on gloo ranks against one process.

The distributed tests train tiny models of each family for 3 steps under tensor parallelism (with FSDP2 over the
other mesh dimensions) and compare every step's loss and gradient norm with one process training the same model
from the same weights on the same global batch: equal within the rounding of a step (``numerics.assert_steps_alike``;
the split sums the same terms in another order). Between them the cases cover every AC mode, the whole-logits and
the chunked loss (computed on vocabulary shards), packed batches with sliding windows, tied embeddings, an uneven
vocabulary, the step in backward, clipping, and compile.
"""

from __future__ import annotations

import math
import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import parallel_testlib
from gloo_testlib import TIMEOUT, run_on_gloo_ranks
from parallel_testlib import CPU, assert_trains_as_one_process, batch, build_model
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.models.families.gemma2 import FAMILY as GEMMA2
from torchtune_ac.models.families.gemma2 import GEMMA2_2B
from torchtune_ac.models.families.gemma3 import FAMILY as GEMMA3
from torchtune_ac.models.families.gemma3 import GEMMA3_1B, GEMMA3_27B
from torchtune_ac.models.families.llama import FAMILY as LLAMA
from torchtune_ac.models.families.llama import LLAMA3_1_70B, LLAMA_TINY
from torchtune_ac.models.families.phi3 import FAMILY as PHI3
from torchtune_ac.models.families.phi3 import PHI4_14B
from torchtune_ac.models.families.qwen3 import FAMILY as QWEN3
from torchtune_ac.models.families.qwen3 import QWEN3_0_6B
from torchtune_ac.models.family import ModelFamily
from torchtune_ac.models.llama import LlamaArgs, RMSNorm
from torchtune_ac.models.tensor_parallel import Split, tensor_parallel_problem
from torchtune_ac.run.weights import initialize_weights_
from torchtune_ac.runtime.distributed import DistributedContext
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.parallelism import TP_DIM, Parallelism
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.config import resolve_ac_plan
from torchtune_ac.activation_checkpointing.mechanism import apply_ac_plan
from torchtune_ac.parallel.fsdp import shard_model
from torchtune_ac.training.step import train_step
from torchtune_ac.parallel.tensor_parallel import apply_tensor_parallel, check_sequence_length, parallel_style

# Tiny models of each family, their flags kept (q/k norms; Gemma 3's offset norms, GeGLU, scaled and tied
# embeddings, sliding windows of 8 tokens on layer 0, a global layer 1). Llama's vocabulary is uneven under 2 x 2.
TINY = {
    "llama": dataclasses.replace(LLAMA_TINY, vocab_size=250, n_layers=2),
    "qwen3": dataclasses.replace(QWEN3_0_6B, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                 head_dim=16, intermediate_dim=128, max_seq_len=64),
    "gemma3": dataclasses.replace(GEMMA3_1B, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  head_dim=None, intermediate_dim=128, max_seq_len=64, sliding_window=8,
                                  query_pre_attn_scalar=16, layer_types=("sliding_attention", "full_attention")),
    # Phi-3's checkpoints stack q/k/v and gate/up; its model holds them apart, split as Llama's.
    "phi3": dataclasses.replace(PHI4_14B, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                intermediate_dim=128, max_seq_len=64),
    # Gemma 2: Gemma 3's block without q/k norms, alternating windows, and caps low enough to bend the scores and
    # logits of weights initialised at std 0.02.
    "gemma2": dataclasses.replace(GEMMA2_2B, vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                  head_dim=None, intermediate_dim=128, max_seq_len=64, sliding_window=8,
                                  query_pre_attn_scalar=16, layer_types=("sliding_attention", "full_attention"),
                                  attn_logit_softcapping=0.05, final_logit_softcapping=0.1),
    # torchao's 8-bit state quantizes each rank's piece in blocks of 256 elements: with rows of 512 and 256 columns
    # per rank (dim, heads x head_dim and the MLP width all 512) a rank's blocks are blocks of the whole tensor.
    "llama_512": dataclasses.replace(LLAMA_TINY, vocab_size=256, dim=512, n_layers=1, intermediate_dim=512),
}
FAMILIES = {"llama": LLAMA, "qwen3": QWEN3, "gemma3": GEMMA3, "phi3": PHI3, "gemma2": GEMMA2}
# Rows, steps and packed documents: parallel_testlib's (Gemma 3's 15-token document is longer than its window).


# ---------------------------------------------------------------------------------------------------------------
# The plans: pure data
# ---------------------------------------------------------------------------------------------------------------

DECODER_BLOCK = {
    "attn_norm": Split.SEQUENCE, "attn": Split.GATHER, "attn.q_proj": Split.COLUMN, "attn.k_proj": Split.COLUMN,
    "attn.v_proj": Split.COLUMN, "attn.o_proj": Split.ROW, "mlp_norm": Split.SEQUENCE, "mlp": Split.GATHER,
    "mlp.gate_proj": Split.COLUMN, "mlp.up_proj": Split.COLUMN, "mlp.down_proj": Split.ROW,
}
QK_NORMS = {"attn.q_norm": Split.HEADS, "attn.k_norm": Split.HEADS}
GEMMA3_POST_NORMS = {"post_attn_norm": Split.SEQUENCE, "post_mlp_norm": Split.SEQUENCE}


@pytest.mark.parametrize("family, extra", [("llama", {}), ("qwen3", QK_NORMS),
                                           ("gemma3", {**QK_NORMS, **GEMMA3_POST_NORMS}), ("phi3", {}),
                                           ("gemma2", GEMMA3_POST_NORMS)])
def test_each_family_declares_its_plan(family, extra) -> None:
    args = TINY[family]
    plan = FAMILIES[family].tensor_parallel_plan(args)
    assert dict(plan.root) == {"tok_embeddings": Split.VOCAB_EMBEDDING, "norm": Split.SEQUENCE,
                               "output": Split.VOCAB_OUTPUT}
    assert dict(plan.block) == {**DECODER_BLOCK, **extra}
    assert dict(plan.divisible) == {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                                    "intermediate_dim": args.intermediate_dim}
    # Every module the plan names exists in the family's block and root.
    with torch.device("meta"):
        model = FAMILIES[family].build(args)
    for path in plan.block:
        transformer_blocks(model)[0].get_submodule(path)
    for path in plan.root:
        model.get_submodule(path)


@pytest.mark.parametrize("args, degree, expected", [
    (LLAMA_TINY, 2, None),
    (LLAMA3_1_70B, 8, None),  # 64 heads, 8 key/value heads, 28,672 columns: the 70B config's TP 8
    (LLAMA_TINY, 4, "tensor_parallel_dim=4: must divide n_kv_heads=2 (fewer than 4: heads are not copied across "
                    "ranks)"),
    (LLAMA_TINY, 3, "tensor_parallel_dim=3: must divide n_heads=4, n_kv_heads=2 (fewer than 3: heads are not "
                    "copied across ranks), intermediate_dim=352"),
    (GEMMA3_1B, 2, "tensor_parallel_dim=2: must divide n_kv_heads=1 (fewer than 2: heads are not copied across "
                   "ranks)"),
    (GEMMA3_27B, 16, None),
    (PHI4_14B, 4, "tensor_parallel_dim=4: must divide n_kv_heads=10"),  # 10 key/value heads: TP 2 or 5, not 4
    (PHI4_14B, 2, None),
    (GEMMA2_2B, 8, "tensor_parallel_dim=8: must divide n_kv_heads=4 (fewer than 8: heads are not copied across "
                   "ranks)"),
    (QWEN3_0_6B, 16, "tensor_parallel_dim=16: must divide n_kv_heads=8 (fewer than 16: heads are not copied across "
                     "ranks)"),
])
def test_a_degree_that_does_not_divide_heads_or_columns_is_refused_in_one_line(args, degree, expected) -> None:
    family = next(f for f in FAMILIES.values() if f.hf.model_type == args.model_type)
    assert tensor_parallel_problem(family.tensor_parallel_plan(args), degree) == expected


def test_applying_a_plan_the_degree_cannot_split_is_refused() -> None:
    """``apply_tensor_parallel`` checks the degree before anything is split (a mesh of 4 is only read for its
    size here: the refusal comes first)."""

    class Mesh4:
        def size(self) -> int:
            return 4

    with torch.device("meta"):
        model = LLAMA.build(LLAMA_TINY)
    with pytest.raises(UserError, match=r"^tensor_parallel_dim=4: must divide n_kv_heads=2 "):
        apply_tensor_parallel(model, Mesh4())
    assert not any(isinstance(p, DTensor) for p in model.parameters())


@pytest.mark.parametrize("world, replicate, tp, expected", [
    (8, 1, 2, None), (8, 2, 2, None), (4, 2, 2, None),
    (6, 1, 4, "tensor_parallel_dim=4, fsdp.replicate_degree=1: the world size (6 process(es)) must be a multiple of "
              "their product (4): it is replicate x shard x tensor-parallel processes"),
    (8, 3, 2, "tensor_parallel_dim=2, fsdp.replicate_degree=3: the world size (8 process(es)) must be a multiple of "
              "their product (6): it is replicate x shard x tensor-parallel processes"),
])
def test_the_world_size_must_be_a_product_of_the_degrees(world, replicate, tp, expected) -> None:
    if expected is None:
        parallelism = Parallelism(world, replicate=replicate, tensor=tp)
        assert parallelism.shard * replicate * tp == world
        assert math.prod(parallelism.mesh_shape.values()) == world
        return
    with pytest.raises(UserError) as error:
        Parallelism(world, replicate=replicate, tensor=tp)
    assert str(error.value) == expected


def test_a_sequence_the_degree_does_not_divide_is_refused() -> None:
    check_sequence_length(32, 2)
    with pytest.raises(ValueError, match=r"^a batch of sequence length 33 under tensor_parallel_dim=2: the length "
                                         r"must be a multiple of the degree"):
        check_sequence_length(33, 2)


# ---------------------------------------------------------------------------------------------------------------
# Training on gloo ranks against one process
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case(parallel_testlib.Case):
    """One training run of a tiny model (a key of ``TINY``)."""

    @property
    def args(self) -> LlamaArgs:
        return TINY[self.model]

    @property
    def family(self) -> ModelFamily:
        return next(f for f in FAMILIES.values() if f.hf.model_type == self.args.model_type)


def check_against_one_process(rank: int, world_size: int,
                              runs: tuple[tuple[tuple[int, int], tuple[Case, ...]], ...]) -> None:
    """Each run's cases trained on its mesh ``(replicate, shard, tp)`` (given as ``(replicate, tp)``) and by one
    process, compared step by step. Reductions over the shard and tp dimensions (the gradient norm) take one
    collective over the flattened group, never one per dimension (which DTensor warns of)."""
    warned: list[str] = []
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    redistribute.addHandler(handler)
    for (replicate, tp), cases in runs:
        parallelism = Parallelism(world_size, replicate=replicate, tensor=tp)
        mesh = parallelism.build_mesh("cpu")
        # Every group of the mesh, the flattened one included, waits as long as the run's group.
        for group in [mesh.get_group(name) for name in (*mesh.mesh_dim_names, "shard_tp")]:
            assert group._get_backend(CPU).options._timeout == TIMEOUT, group.group_desc
        for case in cases:
            # Ranks of one tensor-parallel group are consecutive: they share a data-parallel rank and its rows.
            assert_trains_as_one_process(case, rank, world_size, parallelism, mesh, dp_rank=rank // tp,
                                         dp_degree=world_size // tp,
                                         check_split=lambda model: _check_split(model, case.args, mesh))
    redistribute.removeHandler(handler)
    assert not [message for message in warned if "sequential all_reduce" in message], warned


def _check_split(model: nn.Module, args: LlamaArgs, mesh) -> None:
    """The layers hold this rank's heads and columns, split over ``tp``; the norms are replicated over it."""
    tp = mesh["tp"].size()
    block = transformer_blocks(model)[0]
    q, o, norm = block.attn.q_proj.weight, block.attn.o_proj.weight, block.attn_norm.weight
    assert q.device_mesh.mesh_dim_names == mesh.mesh_dim_names
    assert q.placements[-1] == Shard(0) and o.placements[-1] == Shard(1) and norm.placements[-1] == Replicate()
    embedding = model.tok_embeddings.weight
    assert embedding.placements[-1] == Shard(0)  # along the vocabulary
    if args.tie_embeddings:
        assert model.output.weight is embedding
    # All shards of q_proj over the mesh: a 1/tp of its rows per tp rank (n_heads / tp heads of head_dim).
    assert q.shape == (args.n_heads * args.resolved_head_dim, args.dim)


TWO_RANK_CASES = (
    # Llama: the targets' logits in one chunk on vocabulary shards, no AC; then 3 chunks of them, full
    # AC, packed, activation offloading, the step in backward.
    Case("llama"),
    Case("llama", packed=True, loss_chunks=3, ac_mode="full", offload=True, in_backward=True),
    # Qwen3: per-op AC on packed batches, q/k norms on the local heads; compiled blocks (unpacked: a checkpointed
    # block runs packed batches eagerly).
    Case("qwen3", packed=True, loss_chunks=2, ac_mode="selective", ac_option="op"),
    Case("qwen3", loss_chunks=2, compile=True),
    # Gemma 3: sliding windows within packed documents, tied embeddings, the four norms; selective AC of every
    # block. Gemma 2 (the same block): soft-capped attention per packed document and the soft-capped chunked loss
    # on vocabulary shards, no AC.
    Case("gemma3", packed=True, loss_chunks=2, ac_mode="selective", ac_option=1),
    Case("gemma2", packed=True, loss_chunks=2),
)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_of_tensor_parallelism_train_as_one_process(tmp_path: Path) -> None:
    """TP 2 (FSDP2 over the mesh's shard dimension of 1) against one process, for Llama, Qwen3, Gemma 3 and 2."""
    run_on_gloo_ranks(check_against_one_process, 2, (((1, 2), TWO_RANK_CASES),), store_dir=tmp_path)


def check_low_bit_state(rank: int, world_size: int) -> None:
    """torchao's 8-bit AdamW on split weights: each rank quantizes its own piece (a DTensor of the weight's
    placements holding 8-bit state), and with blocks that are the whole tensor's, trains as one process.

    torchao compiles its update per parameter shape (minutes on a CPU, per process): here it runs eagerly, the same
    arithmetic, by making ``torch.compile`` the identity in this short-lived rank process."""
    torch.compile = lambda function=None, **options: function
    case = Case("llama_512", optimizer="adamw8bit")
    check_against_one_process(rank, world_size, (((1, 2), (case,)),))
    parallelism, ctx = Parallelism(world_size, tensor=2), DistributedContext(rank, world_size, 0, CPU)
    assembled = build_model(case, ctx, parallelism, parallelism.build_mesh("cpu"))
    train_step(assembled.model, assembled.stepper, [batch(case, 0)], ctx=ctx)
    weight = transformer_blocks(assembled.model)[0].attn.o_proj.weight
    state = assembled.stepper.optimizer.state[weight]["exp_avg"]
    assert isinstance(state, DTensor) and state.placements == weight.placements
    assert type(state.to_local()).__name__ == "OptimState8bit" and state.to_local().shape == weight.to_local().shape


@pytest.mark.distributed
@pytest.mark.slow
def test_low_bit_optimizer_state_on_split_weights(tmp_path: Path) -> None:
    run_on_gloo_ranks(check_low_bit_state, 2, store_dir=tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_and_hsdp_with_tensor_parallelism_train_as_one_process(tmp_path: Path) -> None:
    """4 ranks: FSDP2 over 2 x TP 2 with the step in backward (its gradient norm over a shard dimension of 2 and
    the tp one), then HSDP (2 replicas of 1 shard) x TP 2, the 3-D mesh, on packed rows and vocabulary shards.
    (Each layout once: both train plain Llama as one process through ``tune run`` in test_tensor_parallel_runs.py,
    and each feature runs under TP 2 in the 2-rank test above.)"""
    runs = (((1, 2), (Case("gemma3", in_backward=True),)), ((2, 2), (Case("llama", packed=True, loss_chunks=2),)))
    run_on_gloo_ranks(check_against_one_process, 4, runs, store_dir=tmp_path, world_size=4)


class _Norms(nn.Module):
    """One RMSNorm as the only block of a custom model: what FSDP2 and the sequence split make of a norm's weight."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([RMSNorm(dim, eps=1e-6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


def check_norm_gradient_summed_in_fp32(rank: int, world_size: int) -> None:
    mesh = Parallelism(world_size, tensor=world_size).build_mesh("cpu")
    model = _Norms(4)
    norm = model.layers[0]
    parallelize_module(norm, mesh[TP_DIM], parallel_style(Split.SEQUENCE, norm))
    shard_model(model, mesh, FSDPConfig(param_dtype=DType.BF16, reduce_dtype=DType.FP32), dtype=DType.FP32)
    # Each rank's part of the sequence: one token of ones, normalised to ones in bf16, so the weight's partial
    # gradient on a rank is that rank's output gradient: 1 on rank 0, 2**-9 on rank 1, both exact in bf16. Their
    # sum, 1 + 2**-9, is exact in fp32; bf16 (8 significant bits) rounds it to 1.
    output = model(torch.ones(1, 1, 4, dtype=torch.bfloat16))
    (output.float() * (1.0 if rank == 0 else 2.0**-9)).sum().backward()
    gradient = norm.weight.grad.full_tensor()
    assert gradient.dtype == torch.float32
    assert gradient.tolist() == [1.0 + 2.0**-9] * 4


@pytest.mark.distributed
def test_a_norm_weight_gradient_is_summed_over_the_group_in_the_reduce_dtype(tmp_path: Path) -> None:
    """Under mixed precision (bf16 gathered, fp32 reduced) the partial gradients of a replicated weight are summed
    over the tensor-parallel group in fp32, not in bf16 before FSDP2's fp32 reduce-scatter."""
    run_on_gloo_ranks(check_norm_gradient_summed_in_fp32, 2, store_dir=tmp_path)
class _CollectivesIssued(TorchDispatchMode):
    """Counts the functional collectives issued (DTensor's, by name); a result that per-op AC's recompute takes
    from its cache is never issued, so never reaches this mode."""

    COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor")

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in self.COLLECTIVES:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def check_backward_collectives(rank: int, world_size: int) -> None:
    """The collectives each AC mode's backward issues under TP 2 (no FSDP2, whose collectives are not DTensor's).

    torch's ``CommDebugMode`` would count the same, but its module tracker fails on a checkpointed block's
    recompute (torch 2.13: ``KeyError: 'Attention'``), hence a dispatch mode of our own."""
    mesh = Parallelism(world_size, tensor=2).build_mesh("cpu")
    issued = {}
    for mode, option in (("none", None), ("selective", "op"), ("full", None)):
        case = Case("llama", ac_mode=mode, ac_option=option)
        with torch.device("meta"):
            model = LLAMA.build(case.args)
        apply_ac_plan(model, resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=mode, ac_option=option,
                                             n_layers=len(transformer_blocks(model))))
        apply_tensor_parallel(model, mesh["tp"])
        model.to_empty(device=CPU)
        initialize_weights_(model, None, dtype=torch.float32, seed=7, sharded=True)
        loss = model(batch(case, 0)["tokens"]).float().square().mean()
        with _CollectivesIssued() as counter:
            loss.backward()
        issued[mode] = counter.counts
    # Backward's own: each block's all-gathers and reduce-scatters transposed, and the output layer's and the
    # embedding's. Per-op AC issues exactly these; full AC recomputes the blocks' forward collectives as well.
    assert issued["none"]["all_gather_into_tensor"] > 0 and issued["none"]["reduce_scatter_tensor"] > 0, issued
    assert issued["selective"] == issued["none"], issued
    assert issued["full"]["all_gather_into_tensor"] > issued["none"]["all_gather_into_tensor"], issued


@pytest.mark.distributed
def test_per_op_ac_does_not_repeat_tensor_parallel_collectives_in_backward(tmp_path: Path) -> None:
    """Per-op AC keeps the collectives' outputs: its recompute under TP 2 sends nothing the backward without AC
    does not."""
    run_on_gloo_ranks(check_backward_collectives, 2, store_dir=tmp_path)
