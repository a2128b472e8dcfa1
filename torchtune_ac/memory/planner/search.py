"""What the planner chooses and suggests: ``ac_mode: auto``'s plan within a budget (``choose_plan``), the
switches added one by one (``switch_ablation``), and what would fit when nothing does."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.feature import Alternative, Feature
from torchtune_ac.models.families import family_of
from torchtune_ac.models.tensor_parallel import tensor_parallel_problem
from torchtune_ac.activation_checkpointing.mechanism import (
    ACPlan,
)
from torchtune_ac.memory.planner.workload import (
    GiB,
    Workload,
    MemoryEstimate,
    candidate_plans,
)
from torchtune_ac.memory.planner.simulation import (
    _Simulation,
)
from torchtune_ac.memory.planner.estimate import (
    _estimate_plan,
)

def suggested_tensor_parallel_degree(model: nn.Module, world_size: int, gpus_per_node: int = 8) -> Optional[int]:
    """The largest tensor-parallel degree worth suggesting for ``model`` on ``world_size`` processes: within one
    node's GPUs (``gpus_per_node``), dividing the world size, and one the model's plan can split (its heads, key/
    value heads and MLP width); None when there is none above 1 (or the model's family has no plan)."""
    family = family_of(model)
    if family is None or family.tensor_parallel_plan is None:
        return None
    plan = family.tensor_parallel_plan(family.args_of(model))
    return next((degree for degree in range(min(gpus_per_node, world_size), 1, -1)
                 if world_size % degree == 0 and tensor_parallel_problem(plan, degree) is None), None)




def _alternatives(feature: Feature, setting: Any, device: torch.device) -> list[Alternative]:
    """The feature's alternatives that can run on ``device`` (a CUDA-only feature suggests nothing for a CPU run)."""
    usable = []
    for alternative in feature.alternatives(setting):
        try:
            feature.check_device(alternative.setting, device)
        except UnavailableError:
            continue
        usable.append(alternative)
    return usable


def switch_ablation(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    workload: Workload,
    plan: ACPlan,
    device: torch.device,
    fixed: int = 0,
    configured: Optional[MemoryEstimate] = None,
) -> list[tuple[str, MemoryEstimate]]:
    """The estimate of ``plan`` as ``workload`` has its features, then with each feature's first alternative that runs
    on ``device`` added to the ones before, in the features' order (torchtune's ablation, from the planner):
    ``(label, estimate)`` rows, the first labelled ``as configured``. ``fixed`` is the process's fixed cost
    (``MemoryEstimate.fixed``). ``configured``: ``estimate_memory``'s estimate of ``plan`` and ``workload`` with the
    same model and optimizer, when there is one (the first row, not simulated again)."""
    if configured is None:
        configured = _estimate_plan(build_model, make_optimizer, plan, workload, {})
    rows = [("as configured", dataclasses.replace(configured, extra_flops=0.0, fixed=fixed))]
    for feature, setting in workload.feature_settings():
        alternatives = _alternatives(feature, setting, device)
        if not alternatives:
            continue
        alternative = alternatives[0]
        workload = workload.with_settings({feature.name: alternative.setting}, **alternative.workload_changes)
        estimate = _estimate_plan(build_model, make_optimizer, plan, workload, {})
        rows.append((f"+ {alternative.label}", dataclasses.replace(estimate, fixed=fixed)))
    return rows


def choose_plan(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    workload: Workload,
    budget_gib: float,
    n_layers: int,
    fixed: int = 0,
    device: torch.device = torch.device("cpu"),
) -> MemoryEstimate:
    """``ac_mode: auto``: the plan with the least recompute whose estimate fits ``budget_gib`` per process.

    Plans are tried in ``candidate_plans`` order (none, per-op, every k-th block, full) and the first that fits
    wins, so no more plans are simulated than needed. What fits is the step's estimate and the process's fixed
    cost ``fixed`` (bytes, measured when the run starts: see ``MemoryEstimate.device``). ``device`` is where the
    run trains: only the features' alternatives that run there are suggested.

    Raises:
        UserError: no plan fits; one line saying how many GiB are missing even with full AC, and what each knob
            (batch size, sequence length, more processes, and each memory feature's ``alternatives``) would bring
            the full-AC estimate to.
    """
    budget = budget_gib * GiB
    cache: dict[tuple, _Simulation] = {}
    plans = candidate_plans(n_layers)
    estimate = None
    for plan in plans:
        estimate = dataclasses.replace(_estimate_plan(build_model, make_optimizer, plan, workload, cache), fixed=fixed)
        if estimate.device <= budget:
            return estimate
    full = plans[-1]
    knobs = []
    alternatives = []
    if workload.batch_size > 1:
        alternatives.append((f"batch_size={workload.batch_size // 2}", {"batch_size": workload.batch_size // 2}))
    if workload.seq_len > 1:
        alternatives.append((f"max_seq_len={workload.seq_len // 2}", {"seq_len": workload.seq_len // 2}))
    parallelism = workload.parallelism
    alternatives.append((f"{2 * workload.world_size} processes",
                         {"parallelism": dataclasses.replace(parallelism, world_size=2 * workload.world_size)}))
    if parallelism.tensor == 1:
        with FakeTensorMode():
            degree = suggested_tensor_parallel_degree(build_model(), workload.world_size)
        if degree is not None:
            alternatives.append((f"tensor_parallel_dim={degree}",
                                 {"parallelism": dataclasses.replace(parallelism, tensor=degree)}))
    for feature, setting in workload.feature_settings():
        for alternative in _alternatives(feature, setting, device):
            alternatives.append((alternative.label, {"settings": {feature.name: alternative.setting},
                                                     **alternative.workload_changes}))
    for label, change in alternatives:
        change = dict(change)
        changed = workload.with_settings(change.pop("settings", {}), **change)
        total = _estimate_plan(build_model, make_optimizer, full, changed, {}).total + fixed
        knobs.append(f"{label} {total / GiB:.2f} GiB")
    own = f" ({fixed / GiB:.2f} of them the process's own)" if fixed else ""
    raise UserError(
        f"ac_mode=auto: no plan fits ac_memory_budget_gib={budget_gib:g}: even full AC needs an estimated "
        f"{estimate.device / GiB:.2f} GiB per process{own}, {(estimate.device - budget) / GiB:.2f} GiB too many; "
        f"with full AC, {', '.join(knobs)} (see tune plan)"
    )
