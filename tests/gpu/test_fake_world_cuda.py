"""A world of 8 simulated on one GPU (``simulated_world.py``, torch's fake process group): rank 0 of Llama 3.1 8B
and 70B as their configs ship (the 8B's selective AC, the 70B's full AC with the step in backward), real shapes,
random weights, one step. Rank 0's shards and optimizer state equal what ``tune plan --nproc 8`` counts, and the
allocator's peak stays within the plan's step estimate (15 %, the planner's target)."""

from __future__ import annotations

import pytest
import torch
from simulated_world import GiB, fake_world, random_init_overrides, simulate_rank_zero

from torchtune_ac.embedded import ensure_embedded_checkpoint

WORLD = 8
PLAN_TOLERANCE = 0.15
CONFIGS = {"8b": ("llama3_1/8B_full", ["gradient_accumulation_steps=1"]),
           "70b": ("llama3_1/70B_full", ["gradient_accumulation_steps=1"])}


@pytest.mark.parametrize("size", sorted(CONFIGS))
def test_rank_zero_of_a_world_of_8_holds_its_plan(size, tmp_path, record_property):
    config, extra = CONFIGS[size]
    with fake_world(WORLD):
        result = simulate_rank_zero(config, [*random_init_overrides(tmp_path, ensure_embedded_checkpoint(), "cuda"),
                                             *extra], world_size=WORLD, device=torch.device("cuda"))
    print(result)
    for key, value in result.items():
        record_property(key, round(value, 4) if isinstance(value, float) else value)
    assert result["parameters_gib"] == pytest.approx(result["planned_parameters_gib"], rel=1e-6)
    assert result["optimizer_gib"] == pytest.approx(result["planned_optimizer_gib"], rel=1e-3)
    assert result["peak_allocated_gib"] <= result["planned_total_gib"] * (1 + PLAN_TOLERANCE), result
    assert result["peak_allocated_gib"] >= result["planned_total_gib"] * (1 - PLAN_TOLERANCE), result
    assert result["peak_reserved_gib"] * GiB <= torch.cuda.get_device_properties(0).total_memory
