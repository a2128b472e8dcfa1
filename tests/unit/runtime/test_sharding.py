"""``shard_model``: which modules become FSDP2 groups, how each reshards, the mixed-precision policy, and the
device mesh every ``fully_shard`` call is given (of the run's device type, 1-D, or 2-D for HSDP).

Most of this shows on a world of one (an in-process gloo group, as a single process with CPU offload shards);
the HSDP mesh and placements need 4 processes. What can only be shown on a GPU host, ``device: cpu`` with several
processes there, rests on the mesh's device type checked here with ``torch.cuda.is_available`` patched to True.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from gloo_testlib import TIMEOUT, run_on_gloo_ranks
from numerics import assert_close
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchtune_ac.checkpoint import local_region
from torchtune_ac.errors import UserError
from torchtune_ac.memory.optimizer_in_backward import OptimizerInBackward
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.models.llama import Llama
from torchtune_ac.runtime.distributed import DistributedContext, destroy_distributed, join_world_of_one
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.parallel import fsdp
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.parallel.fsdp import shard_model
from torchtune_ac.run.assemble import AssemblyPlan, build_mesh
from torchtune_ac.activation_checkpointing.config import ACConfig

CPU = torch.device("cpu")
SMALL = dataclasses.replace(LLAMA_TINY, n_layers=2)


def _meta_model(**changes: Any) -> nn.Module:
    with torch.device("meta"):
        return Llama(dataclasses.replace(SMALL, **changes))


@pytest.fixture
def world_of_one():
    join_world_of_one(CPU)
    yield
    destroy_distributed()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[nn.Module, ...], dict[str, Any]]]:
    """Every ``fully_shard`` call ``shard_model`` makes: the modules of the group, and the keyword arguments."""
    recorded = []
    real = fsdp.fully_shard

    def record(module, **kwargs):
        recorded.append((tuple(module) if isinstance(module, list) else (module,), kwargs))
        return real(module, **kwargs)

    monkeypatch.setattr(fsdp, "fully_shard", record)
    return recorded


def test_blocks_embeddings_and_head_are_groups_of_their_own(world_of_one, calls) -> None:
    model = _meta_model()
    shard_model(model, Parallelism(1).build_mesh("cpu"), FSDPConfig(reshard_after_forward=True), dtype=DType.FP32)
    groups = [modules for modules, _ in calls]
    assert groups == [(model.layers[0],), (model.layers[1],), (model.tok_embeddings,), (model.norm, model.output),
                      (model,)]
    assert all(isinstance(m, FSDPModule) for group in groups for m in group)
    # The embeddings are used first in forward and last in backward: resharded in between. [norm, output] and the
    # root run last in forward, first in backward: kept gathered.
    reshard = [kwargs["reshard_after_forward"] for _, kwargs in calls]
    assert reshard == [True, True, True, False, False]
    # The root holds no parameter of its own any more.
    root_params = {id(p) for p in model.parameters()} - {id(p) for group in groups[:-1] for m in group
                                                          for p in m.parameters()}
    assert root_params == set()


def test_without_resharding_no_group_reshards(world_of_one, calls) -> None:
    shard_model(_meta_model(), Parallelism(1).build_mesh("cpu"), FSDPConfig(reshard_after_forward=False), dtype=DType.FP32)
    assert not any(kwargs["reshard_after_forward"] for _, kwargs in calls)


def test_a_tied_embedding_stays_in_one_group_the_root(world_of_one, calls) -> None:
    model = _meta_model(tie_embeddings=True)
    shard_model(model, Parallelism(1).build_mesh("cpu"), FSDPConfig(), dtype=DType.FP32)
    groups = [modules for modules, _ in calls]
    assert groups == [(model.layers[0],), (model.layers[1],), (model,)]
    assert model.output.weight is model.tok_embeddings.weight
    assert isinstance(model.tok_embeddings.weight, DTensor)


@pytest.mark.parametrize(
    "storage, reduce_dtype, expected",
    [
        (DType.BF16, None, torch.bfloat16),  # the default: reduce as stored, no upcast for the collective
        (DType.FP32, None, torch.float32),
        (DType.BF16, DType.FP32, torch.float32),  # still selectable
    ],
)
def test_the_reduce_dtype_defaults_to_the_storage_dtype(world_of_one, calls, storage, reduce_dtype, expected) -> None:
    shard_model(_meta_model().to(storage.torch), Parallelism(1).build_mesh("cpu"), FSDPConfig(reduce_dtype=reduce_dtype), dtype=storage)
    assert {kwargs["mp_policy"].reduce_dtype for _, kwargs in calls} == {expected}


def test_every_group_is_sharded_over_a_mesh_of_the_run_device(world_of_one, calls, monkeypatch) -> None:
    """A GPU host running ``device: cpu``: the mesh is the CPU's, not the accelerator's. Without ``mesh=``,
    ``fully_shard`` would build its own from whatever accelerator the machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(MemoryPlan, "shard_options", lambda self: {"offload_policy": None})  # one process shards
    mesh = build_mesh(AssemblyPlan(DType.FP32, MemoryPlan(ac=ACConfig().resolve(2))),
                      DistributedContext(0, 1, 0, CPU))
    shard_model(_meta_model(), mesh, FSDPConfig(), dtype=DType.FP32)
    assert mesh.device_type == "cpu" and mesh.mesh_dim_names == ("shard",)
    assert all(kwargs.get("mesh") is mesh for _, kwargs in calls)


@pytest.mark.parametrize("world_size, replicate_degree", [(3, 2), (1, 2), (4, 3)])
def test_a_world_that_is_not_whole_rows_of_replicas_is_refused(world_size, replicate_degree) -> None:
    with pytest.raises(UserError) as error:
        Parallelism(world_size, replicate=replicate_degree)
    message = str(error.value)
    assert message.startswith(f"fsdp.replicate_degree={replicate_degree}:") and "\n" not in message
    assert f"world size ({world_size} process(es))" in message


def _check_hsdp(rank: int) -> None:
    model = _meta_model()
    mesh = Parallelism(4, replicate=2).build_mesh("cpu")
    shard_model(model, mesh, FSDPConfig(replicate_degree=2), dtype=DType.FP32)
    assert mesh.mesh_dim_names == ("replicate", "shard") and tuple(mesh.shape) == (2, 2)
    # Consecutive ranks share a row (one node per replica keeps the shard collectives inside the node).
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]]
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.device_mesh == mesh, name
        assert param.placements == (Replicate(), Shard(0)), (name, param.placements)
    assert dist.get_world_size(mesh.get_group("shard")) == 2
    # Its sub-groups wait as long as the run's group (``distributed_timeout_s``), not torch's default 30 minutes.
    for name in mesh.mesh_dim_names:
        assert mesh.get_group(name)._get_backend(CPU).options._timeout == TIMEOUT, name
    _check_in_backward_norm(model)


def _check_in_backward_norm(model: nn.Module) -> None:
    """The step in backward sums its shards' squared norms over a row, not over every rank: a replica holds the
    same shard, and counting it twice would make the norm sqrt(2) too large. The reference is the gradients'
    DTensor norm after a plain backward of the same batch (the in-backward step, at lr 0, changes nothing)."""
    model.to_empty(device=CPU)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            full = torch.randn(param.shape, generator=generator) * 0.02
            local, region = local_region(param)
            local.copy_(full[region])
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16), generator=generator)
    in_backward = OptimizerInBackward(model.named_parameters(), lambda params: torch.optim.SGD(params, lr=0.0))
    in_backward.begin_micro_batch(final=True)
    model(tokens).float().square().mean().backward()
    measured = in_backward.total_norm(CPU)
    in_backward.remove_hooks()
    model(tokens).float().square().mean().backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=float("inf")).full_tensor()
    # The same gradients (the same ops replayed), their squares summed in another order: within the rounding of a
    # sum over every gradient entry.
    assert_close(measured, expected, terms=sum(p.numel() for p in model.parameters()), what="total gradient norm")


def test_a_mesh_builds_over_a_simulated_world() -> None:
    """torch's fake process group (a world of 8 simulated in one process) has no timeout to give the sub-groups."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        mesh = Parallelism(8, replicate=2, tensor=2).build_mesh("cpu")
        assert tuple(mesh.shape) == (2, 2, 2) and dist.get_world_size(mesh.get_group("shard_tp")) == 4
    finally:
        destroy_distributed()


@pytest.mark.distributed
def test_hsdp_shards_within_a_row_and_replicates_across(tmp_path: Path) -> None:
    run_on_gloo_ranks(_check_hsdp, store_dir=tmp_path, world_size=4)


def test_the_output_layer_runs_its_forward_on_the_head_path_too() -> None:
    """A chunked loss replaces the output projection by a head; the head must still run inside the output layer's
    forward, or FSDP2 never sees the [norm, output] group finish its forward (torch 2.11 then leaves the group
    waiting, and the next step's forward uses the sharded weight; torch 2.13 completes it from the root)."""
    model = Llama(SMALL)
    ran = []
    model.output.register_forward_hook(lambda module, args, out: ran.append(out))
    tokens = torch.randint(0, SMALL.vocab_size, (1, 8))
    loss = model(tokens, head=lambda hidden, weight: (hidden @ weight.T).sum())
    assert len(ran) == 1 and ran[0] is loss
    logits = model(tokens)
    assert len(ran) == 2 and ran[1] is logits and logits.shape == (1, 8, SMALL.vocab_size)
