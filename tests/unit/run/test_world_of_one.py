"""A memory switch that works through FSDP2 (``shard_options``) makes a single process shard its model, on a
world of one: the run joins a process group of its own, its parameters become DTensors, and it trains as the
unsharded model does (gloo on CPU, with FSDP2's no-op ``OffloadPolicy`` standing in for a switch's options)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import OffloadPolicy
from torch.distributed.tensor import DTensor

from torchtune_ac.config.components import parse_component
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.run.assemble import AssemblyPlan, build_training
from torchtune_ac.runtime.distributed import DistributedContext, destroy_distributed
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.training.step import OptimizerStepper, train_step

CTX = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
MODEL = parse_component({"_component_": "torchtune_ac.models.llama_tiny"}, "model")
PLAN = MemoryPlan(ac=ACConfig().resolve(8))


def _losses(model: torch.nn.Module) -> list[float]:
    stepper = OptimizerStepper(torch.optim.AdamW(model.parameters(), lr=1e-2))
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 512, (2, 32), generator=generator)
        batch = {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1)}
        losses.append(train_step(model, stepper, [batch], ctx=CTX).loss)
    return losses


def _build() -> torch.nn.Module:
    return build_training(build_meta_model(MODEL), AssemblyPlan(dtype=DType.FP32, memory=PLAN, seed=0), ctx=CTX).model


@pytest.fixture
def shard_options(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(MemoryPlan, "shard_options", lambda self: {"offload_policy": OffloadPolicy()})
    yield
    destroy_distributed()


def test_a_switch_with_shard_options_shards_one_process_and_trains_the_same(shard_options) -> None:
    sharded = _build()
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert all(isinstance(p, DTensor) for p in sharded.parameters())
    with_options = _losses(sharded)
    destroy_distributed()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MemoryPlan, "shard_options", lambda self: {})
        plain = _build()
    assert not dist.is_initialized()
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    # One rank: the all-gather and reduce-scatter copy, so the arithmetic is the same ops on the same values.
    assert with_options == _losses(plain)
