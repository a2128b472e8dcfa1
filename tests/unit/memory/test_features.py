"""The memory features: listed once, in order (``memory/features.py``); their keys written in the schema's groups
(``MemoryConfig``, the one ``FSDPConfig``), their settings typed (``MemorySettings``); the plan, the step and the
planner go through what each declares, and a new feature is one record in the list and one field of its settings,
whose cost the planner counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtune_ac.memory import features, planner
from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropyObjective
from torchtune_ac.memory.feature import Feature, FeatureCost
from torchtune_ac.memory.features import FEATURES, STEP_FEATURES, MemorySettings
from torchtune_ac.memory.optimizer_in_backward import InBackwardStepper
from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan
from torchtune_ac.memory.planner import Workload, estimate_memory
from torchtune_ac.models import LlamaArgs
from torchtune_ac.models.llama import Llama
from torchtune_ac.parallel.fsdp import FSDPConfig
from torchtune_ac.activation_checkpointing.config import ACConfig
from torchtune_ac.activation_checkpointing.mechanism import ACMode
from torchtune_ac.training.step import OptimizerStepper

ARGS = LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=32)


def test_the_features_are_listed_in_order_and_their_keys_are_written_in_memory_config_and_fsdp_config():
    assert [f.name for f in FEATURES] == ["ac", "optimizer_state", "optimizer_in_bwd", "loss_chunks",
                                          "enable_activation_offloading", "cpu_offload"]
    assert {f.name for f in dataclasses.fields(MemoryConfig)} == {"optimizer_in_bwd", "loss_chunks",
                                                                  "enable_activation_offloading"}
    assert MemoryConfig().loss_chunks is None and MemoryConfig().optimizer_in_bwd is False
    # CPU offload's key is an fsdp.* key, a field of the one FSDPConfig.
    assert {f.name for f in dataclasses.fields(FSDPConfig)} == {"reshard_after_forward", "param_dtype",
                                                                "reduce_dtype", "replicate_degree", "cpu_offload"}
    assert FSDPConfig().cpu_offload is False


def test_each_step_feature_has_one_typed_setting_whose_default_is_its_off_setting():
    fields = dataclasses.fields(MemorySettings)
    assert [f.name for f in fields] == [feature.name for feature in STEP_FEATURES]
    assert [MemorySettings().of(feature) for feature in STEP_FEATURES] == [feature.off for feature in STEP_FEATURES]
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(loss_chunks=3), Llama(ARGS),
                               clip_grad_norm=None)
    assert plan.settings == MemorySettings(loss_chunks=3)


@pytest.mark.parametrize("in_bwd, chunks, stepper_type, objective", [
    (False, 1, OptimizerStepper, ChunkedCrossEntropyObjective(1)),
    (True, 1, InBackwardStepper, ChunkedCrossEntropyObjective(1)),
    (False, 3, OptimizerStepper, ChunkedCrossEntropyObjective(3)),
])
def test_the_plan_builds_the_stepper_and_objective_its_features_declare(in_bwd, chunks, stepper_type, objective):
    model = Llama(ARGS)
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(optimizer_in_bwd=in_bwd, loss_chunks=chunks),
                               model, clip_grad_norm=None)
    assert [label for label, _ in plan.describe()] == ["activation checkpointing", "optimizer state", "optimizer step",
                                                       "loss", "activation offloading", "CPU offload"]
    assert isinstance(plan.build_stepper(lambda p: torch.optim.SGD(p, lr=0.1), model), stepper_type)
    assert plan.objective() == objective
    # In a run that compiles, the chunked loss compiles its chunks too; all targets at once stay eager.
    assert plan.objective(compiled=True) == (ChunkedCrossEntropyObjective(chunks, compiled=True) if chunks > 1
                                             else objective)
    assert plan.resume_record() == ({"optimizer_in_bwd": True} if in_bwd else {})


def _park_cost(setting: bool, sizes) -> FeatureCost:
    if not setting:
        return FeatureCost()
    return FeatureCost(device={"optimizer": -sizes.optimizer_state}, host={"optimizer": sizes.optimizer_state})


# A feature that parks the optimizer state on the host: a record with its resolution, description and cost.
PARK = Feature(name="park", label="parking", off=False, resolve=lambda inputs: False,
               describe=lambda setting, vocab_size: "on the host" if setting else "off", planner_cost=_park_cost)


@dataclasses.dataclass(frozen=True)
class ParkSettings(MemorySettings):
    """The settings with PARK's: a new feature is one more typed field."""

    park: bool = False


@pytest.fixture
def with_park(monkeypatch: pytest.MonkeyPatch) -> None:
    """The list with PARK added before CPU offload (the planner reads the step's features from it)."""
    listed = (*FEATURES[:-1], PARK, FEATURES[-1])
    monkeypatch.setattr(features, "FEATURES", listed)
    monkeypatch.setattr(features, "STEP_FEATURES", listed[1:])
    monkeypatch.setattr(planner.workload, "STEP_FEATURES", listed[1:])


@dataclasses.dataclass(frozen=True)
class WatchSettings(ParkSettings):
    watch: None = None


def test_a_new_feature_is_one_record_in_the_list_and_the_planner_counts_its_declared_cost(with_park):
    workload = Workload(batch_size=1, seq_len=16, settings=ParkSettings())
    plans = [ACConfig(ac_mode=ACMode.FULL).resolve(ARGS.n_layers)]
    off, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload, plans)
    on, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p), workload.with_settings({"park": True}),
                          plans)
    assert off.host == 0 and off.optimizer > 0
    assert on.host == off.optimizer and on.optimizer == 0 and on.host_parts == {"optimizer": off.optimizer}
    assert on.total == off.total - off.optimizer


def test_planner_costs_come_in_order_each_seeing_the_estimate_so_far_and_the_model_s_sizes(with_park, monkeypatch):
    seen = []

    def watch_cost(setting, sizes) -> FeatureCost:
        seen.append((dict(sizes.so_far), sizes.shapes, sizes.dtype, sizes.checkpointed_blocks, sizes.block_input))
        return FeatureCost()

    watch = Feature(name="watch", label="watching", off=None, resolve=lambda inputs: None,
                    describe=lambda setting, vocab_size: "", planner_cost=watch_cost)
    listed = (*features.FEATURES[:-1], watch, features.FEATURES[-1])  # after PARK
    monkeypatch.setattr(planner.workload, "STEP_FEATURES", listed[1:])
    plans = [ACConfig(ac_mode=ACMode.FULL).resolve(ARGS.n_layers)]
    estimate, = estimate_memory(lambda: Llama(ARGS), lambda p: torch.optim.AdamW(p),
                                Workload(batch_size=1, seq_len=16, settings=WatchSettings(park=True)), plans)
    so_far, shapes, dtype, checkpointed, block_input = seen[-1]  # full AC (the first: no AC, the baseline)
    assert so_far["optimizer"] == 0 and so_far["parameters"] == estimate.parameters  # after park moved it
    model = Llama(ARGS)
    assert sorted(shapes) == sorted(tuple(p.shape) for p in model.parameters()) and dtype == torch.float32
    assert checkpointed == ARGS.n_layers and block_input == 1 * 16 * ARGS.dim * 4  # batch x seq x dim, fp32
