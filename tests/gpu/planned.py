"""``tune plan``'s row for a config's own AC setting, computed as its table computes it, without the other rows (the
whole table simulates every AC setting and the switches' ablation: many times the work, for one row)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
from torchtune_ac.config.meta_model import build_meta_model
from torchtune_ac.memory.planner import MemoryEstimate, estimate_memory
from torchtune_ac.run.plan import RunPlan, planner_inputs, resolve_run_plan


def plan_config(recipe_name: str, config: str, overrides: Sequence[str], *, world_size: int
                ) -> tuple[Any, RunPlan, torch.nn.Module, MemoryEstimate]:
    """The validated config, its run plan on ``world_size`` processes, its meta model, and the planner's estimate
    of one process's step for the plan's AC setting (``total``: the allocator's share, the fixed cost left out)."""
    recipe = load_recipe(resolve_recipe_path(recipe_name))
    cfg = load_recipe_config(recipe, config, list(overrides), [])
    model = build_meta_model(cfg.model, cfg.checkpoint_dir)
    plan = resolve_run_plan(cfg, model, world_size=world_size)
    inputs = planner_inputs(cfg, plan.parallelism, torch.device("cpu"))
    workload = inputs.workload.with_settings(plan.memory.settings, clip_grad_norm=cfg.clip_grad_norm)
    (estimate,) = estimate_memory(inputs.build_model, inputs.make_optimizer, workload, [plan.memory.ac])
    return cfg, plan, model, estimate
