"""The estimate of an AC plan from its simulations: two depths extrapolated to the model's, the shares FSDP2 and
tensor parallelism divide, the features' declared costs (``estimate_memory``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from torchtune_ac.memory import cpu_offload
from torchtune_ac.memory.feature import ModelSizes
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.activation_checkpointing.mechanism import (
    ACPlan,
)
from torchtune_ac.memory.planner.workload import (
    PHASES,
    Workload,
    MemoryEstimate,
    candidate_plans,
    _plan,
)
from torchtune_ac.memory.planner.rollouts import model_shape, rollout_memory
from torchtune_ac.memory.planner.simulation import (
    _Simulation,
    _simulate,
    repeating_blocks,
)

def _extrapolate(a: float, b: float, depth_a: int, depth_b: int, depth: int) -> float:
    return a + (b - a) * (depth - depth_a) / (depth_b - depth_a)


def _estimate(plan: ACPlan, shallow: _Simulation, deep: Optional[_Simulation], workload: Workload) -> MemoryEstimate:
    """The estimate at ``plan.n_layers`` blocks from one simulation at that depth (``deep`` None) or two
    shallower ones, with FSDP2's share added (``extra_flops`` is left at 0: see ``estimate_memory``)."""
    n, depth = workload.shard_degree, plan.n_layers

    def at_depth(get: Callable[[_Simulation], float]) -> float:
        if deep is None:
            return get(shallow)
        return _extrapolate(get(shallow), get(deep), shallow.n_blocks, deep.n_blocks, depth)

    peaks = {phase: tuple(at_depth(lambda s, p=phase, f=f: getattr(s.peaks[p], f)) for f in ("value", "other", "grads", "acts"))
             for phase in PHASES}
    phase = max(PHASES, key=lambda p: peaks[p][0])
    _, other, grads, acts = peaks[phase]
    # Under expert parallelism the simulated process held its E / ep experts of each layer: the whole model (what
    # FSDP2 shards, ep x expert_shard = shard processes for the experts as for the rest) has ep times as many.
    ep = workload.parallelism.expert
    simulated = at_depth(lambda s: s.parameters)
    parameters = simulated + (ep - 1) * at_depth(lambda s: s.expert_parameters)
    optimizer = at_depth(lambda s: s.optimizer + (ep - 1) * s.expert_optimizer)
    sharded = workload.world_size > 1 or bool(cpu_offload.shard_options(workload.settings.cpu_offload))
    gathered = 0
    fsdp_extra = 0.0
    if sharded:
        root = shallow.root_parameters
        reduce_factor = workload.fsdp.resolved_reduce_dtype(workload.dtype).torch.itemsize / workload.dtype.torch.itemsize
        if ep == 1:
            blocks = parameters - root if not workload.fsdp.reshard_after_forward else 2 * shallow.block_parameters
            gathered = root + blocks
            # Gathered parameters beyond the resident shards (the groups outside the blocks counted gathered
            # throughout), and the reduce-scatter input of the largest group.
            largest_group = max(shallow.block_parameters, shallow.largest_outer_group)
            fsdp_extra = gathered * (n - 1) / n + largest_group * reduce_factor
        else:
            gathered, fsdp_extra = _expert_parallel_gathered(shallow, workload, simulated, at_depth, reduce_factor)
    # Tensor parallelism splits every parameter (and its gradient and optimizer state) over tp more processes, and
    # the activations of the split layers: the simulation ran the whole model, so its parts are divided by tp, and
    # what stays whole on every rank of a group is added back (tensor_parallel_share).
    tp = workload.parallelism.tensor
    device = {
        "parameters": parameters / n / tp,
        "optimizer": optimizer / n / tp,
        "gradients": grads / tp,
        "activations": acts / tp,
        "transient": (other + fsdp_extra) / tp + shallow.batch + workload.blas_workspaces,
    }
    if tp > 1:
        for category, nbytes in tensor_parallel_share(plan, shallow, workload, phase).items():
            device[category] += nbytes
    device["transient"] += in_backward_stream_pool(shallow, workload, sharded) / n / tp
    if shallow.varlen_kv_copy:
        # varlen_attn saves its K/V copies for backward: a block without AC keeps them until its backward; the block
        # running (or recomputing) holds its own as it goes (a group's rank, its heads' share).
        copy = shallow.varlen_kv_copy / tp
        if phase != "optimizer step":
            device["activations"] += copy * (depth - len(plan.checkpointed_blocks))
        device["transient"] += copy
    # What the simulation cannot show, as each feature declares it, in the features' order: each sees the estimate
    # with the earlier ones' costs.
    shapes = shallow.root_shapes + shallow.block_shapes * (depth - shallow.fixed_blocks)
    host: dict[str, float] = {}
    for feature, setting in workload.feature_settings():
        sizes = ModelSizes(parameters=math.ceil(parameters), root_parameters=shallow.root_parameters,
                           largest_block=shallow.block_parameters,
                           optimizer_state=math.ceil(optimizer), world_size=n * tp,
                           shapes=shapes, dtype=workload.dtype.torch, sharded=sharded,
                           gathered_parameters=math.ceil(gathered / tp),
                           checkpointed_blocks=len(plan.checkpointed_blocks), block_input=shallow.block_input,
                           max_gradients=math.ceil(max(peak[2] for peak in peaks.values())),
                           so_far={category: math.ceil(nbytes) for category, nbytes in device.items()})
        cost = feature.planner_cost(setting, sizes)
        for category, nbytes in cost.device.items():
            device[category] += nbytes
        for category, nbytes in cost.host.items():
            host[category] = host.get(category, 0) + nbytes
    # A resident reference: the policy's parameters again, sharded alike; kept in host memory with CPU offload.
    reference = parameters / n / tp if workload.preference is not None and workload.preference.resident_reference else 0
    if reference and workload.settings.cpu_offload:
        host["reference"] = reference
        reference = 0
    return MemoryEstimate(
        plan=plan,
        reference=math.ceil(reference),
        parameters=math.ceil(device["parameters"]),
        optimizer=math.ceil(device["optimizer"]),
        gradients=math.ceil(device["gradients"]),
        activations=math.ceil(device["activations"]),
        transient=math.ceil(device["transient"]),
        saved_activations=math.ceil(at_depth(lambda s: s.saved_activations)),
        extra_flops=0.0,
        peak_phase=phase,
        flops=at_depth(lambda s: s.flops),
        host=math.ceil(sum(host.values())),
        host_parts={category: math.ceil(nbytes) for category, nbytes in host.items()},
    )


def _expert_parallel_gathered(shallow: _Simulation, workload: Workload, simulated: float,
                              at_depth: Callable[[Callable[[_Simulation], float]], float],
                              reduce_factor: float) -> tuple[float, float]:
    """What FSDP2 holds gathered under expert parallelism (unsharded), and what that and its reduce-scatter input
    add beyond the resident shards. Each layer's experts are a group of their own: a process gathers only its
    E / ep experts (over the ``expert_shard`` processes that hold the same ones), the dense rest of a block over
    ``shard`` as in a dense model. The experts' gathered copy is counted whole: FSDP2 copies a process's own shard
    into it too, with ``expert_shard`` 1 as well (``FSDPParamGroup.wait_for_unshard``)."""
    n = workload.shard_degree
    root = shallow.root_parameters
    if workload.fsdp.reshard_after_forward:  # the running block and the prefetched one
        experts = 2 * shallow.block_expert_parameters
        dense = 2 * (shallow.block_parameters - shallow.block_expert_parameters)
    else:
        experts = at_depth(lambda s: s.expert_parameters)
        dense = simulated - root - experts
    largest_group = max(shallow.block_parameters - shallow.block_expert_parameters, shallow.block_expert_parameters,
                        shallow.largest_outer_group)
    extra = (root + dense) * (n - 1) / n + experts + largest_group * reduce_factor
    return root + dense + experts, extra


def in_backward_stream_pool(shallow: _Simulation, workload: Workload, sharded: bool) -> int:
    """Unsharded bytes a GPU holds apart for the optimizer stepping in backward under FSDP2: the most its step of
    one parameter holds at once (its temporaries), 0 elsewhere.

    FSDP2 calls the parameters' gradient hooks on its reduce-scatter stream (HSDP: its all-reduce stream), so the
    step's temporaries come from that stream's pool of the caching allocator, which the default stream's
    allocations cannot reuse (nor the other way round): the simulation, one pool, would let the two share bytes.
    The step stays on that stream, overlapping the next block's backward (docs/memory.md, "The step in backward
    and FSDP2's streams"). Its state, allocated there on the first step, is counted as the optimizer's. With CPU
    offload the step runs on the host, on the host's shards."""
    if not (workload.cuda and sharded and workload.settings.optimizer_in_bwd) or workload.settings.cpu_offload:
        return 0
    return shallow.optimizer_temporaries_in_backward


def tensor_parallel_share(plan: ACPlan, shallow: _Simulation, workload: Workload, phase: str) -> dict[str, float]:
    """What tensor parallelism leaves whole on every rank of a group, beyond the 1/tp share of the simulated step.

    Sequence parallelism splits a block's input, its norms and residuals along the sequence, but the attention and
    the MLP each gather their normed input whole (``[b, s, dim]``): a block without AC keeps both for backward (a
    checkpointed one keeps only its split input), and the block running or recomputing holds them. The whole
    logits (a preference step's at ``loss_chunks: 1``, or an output projection that takes no head) are gathered on
    every rank; the loss through the head (any ``loss_chunks``) computes on vocabulary shards.
    """
    tp = workload.parallelism.tensor
    whole = 1 - 1 / tp
    gathered_inputs = 2 * shallow.block_input * whole
    share = {"activations": 0.0, "transient": gathered_inputs}
    if phase != "optimizer step":
        share["activations"] = gathered_inputs * (plan.n_layers - len(plan.checkpointed_blocks))
    share["transient"] += shallow.logits * whole  # 0 where the loss runs through the head (``_Simulation.logits``)
    return share




def _depths(plan: ACPlan, fixed: int = 0) -> tuple[int, Optional[int]]:
    """The two depths that repeat the plan's pattern over the repeating blocks, after the ``fixed`` blocks before
    them (``repeating_blocks``; the second None: simulate the whole model)."""
    period = plan.option if isinstance(plan.option, int) else 1
    first = period * max(1, math.ceil(2 / period))
    second = 2 * first
    return (fixed + first, fixed + second) if fixed + second < plan.n_layers else (plan.n_layers, None)


def estimate_memory(
    build_model: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    workload: Workload,
    plans: Optional[Sequence[ACPlan]] = None,
) -> list[MemoryEstimate]:
    """Estimate the memory per process of a training step for each AC plan (default: ``candidate_plans``).

    Args:
        build_model: builds the model on the current default device (called under fake tensors: no memory).
        make_optimizer: the config's optimizer, called with parameters.
        workload: what one process does per step.
        plans: the AC plans to estimate, resolved for the model's layer count.

    Returns:
        One estimate per plan, in order; ``extra_flops`` is relative to the same step without AC.
    """
    if plans is None:
        with FakeTensorMode():
            plans = candidate_plans(len(transformer_blocks(build_model())))
    plans = list(plans)
    cache: dict[tuple, _Simulation] = {}
    none = _plan("none", None, plans[0].n_layers)
    baseline = _estimate_plan(build_model, make_optimizer, none, workload, cache).flops
    return [dataclasses.replace(estimate, extra_flops=estimate.flops / baseline - 1)
            for estimate in (_estimate_plan(build_model, make_optimizer, plan, workload, cache) for plan in plans)]




def _estimate_plan(build_model, make_optimizer, plan: ACPlan, workload: Workload,
                   cache: dict[tuple, Any]) -> MemoryEstimate:
    """One plan's estimate (its extra FLOPs left at 0: no baseline is simulated), reusing ``cache``."""

    def simulate(depth: Optional[int]) -> _Simulation:
        key = (plan.mode.value, plan.option, depth, workload)
        if key not in cache:
            cache[key] = _simulate(build_model, make_optimizer, plan.mode.value, plan.option, depth, workload)
        return cache[key]

    if ("fixed",) not in cache:  # the blocks before the repeating ones, simulated whole at every depth
        with FakeTensorMode():
            cache[("fixed",)] = repeating_blocks(build_model())[0]
    first, second = _depths(plan, cache[("fixed",)])
    estimate = _estimate(plan, simulate(first if second else None), simulate(second) if second else None, workload)
    return estimate if workload.rollouts is None else _with_rollouts(estimate, build_model, workload)


def _with_rollouts(estimate: MemoryEstimate, build_model: Callable[[], nn.Module],
                   workload: Workload) -> MemoryEstimate:
    """A GRPO step's estimate: the rollouts' tensors (``rollouts.py``), and the resident reference, the policy's
    parameters again (host memory with CPU offload)."""
    with FakeTensorMode():
        shape = model_shape(build_model())
    memory = rollout_memory(workload.rollouts, shape, workload.dtype.torch, workload.parallelism.tensor)
    reference, host_parts = estimate.reference, dict(estimate.host_parts)
    if workload.rollouts.reference:
        if workload.settings.cpu_offload:
            host_parts["reference"] = host_parts.get("reference", 0) + estimate.parameters
        else:
            reference += estimate.parameters
    return dataclasses.replace(estimate, rollouts=memory.total, reference=reference, host_parts=host_parts,
                               host=sum(host_parts.values()),
                               peak_phase="generation" if memory.total > estimate.step_peak else estimate.peak_phase)
