"""The order in which a run applies its plan to a model, in one function: ``build_training``.

    1. adapters  2. activation checkpointing  3. activation offloading  4. compile  5. tensor parallelism
    6. expert parallelism  7. FSDP2  8. materialise  9. load or initialise  10. optimizer  11. stepper
    12. scheduler

Every step is a mechanism of its own module, called here by name (AC's and the memory features' in ``memory/``
and ``training/``, tensor, expert parallelism's and FSDP2's in ``parallel/``), and guarded by the plan: the parallelism
value says which splits run, over the one device mesh of the run (``build_mesh``). The order is the one that works
for 1 and N processes: AC first, so that compile traces each checkpointed forward (per-op policy included) and
FSDP2's hooks wrap the checkpointed blocks; tensor and expert parallelism before FSDP2, which shards over the other
mesh dimensions; the adapters before all of them, so that AC's policy, compile and FSDP2 see the adapted linears
as the model's own (the adapters' values drawn once the base is loaded: step 0 is the base); nothing is
materialised before sharding, so no rank ever holds the full model, and the initial weights
are the same for any world size and device (``weights.py``). The optimizer comes after FSDP2: it steps the sharded
parameters, and the step in backward hooks them.

``build_reference`` runs the same order for a model that never trains (DPO's reference): no AC, offloading or
compile, every FSDP2 group resharded after its forward, no optimizer, frozen.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtune_ac.lora.config import AdapterConfig, QuantizeBase
from torchtune_ac.lora.mechanism import apply_adapters, base_only
from torchtune_ac.lora.sharded_nf4 import nf4_from_dense, store_base_as_nf4_
from torchtune_ac.lora.weights import load_or_initialize_adapters_
from torchtune_ac.activation_checkpointing.mechanism import ACMode, apply_ac_plan, silence_compiled_policy_warning
from torchtune_ac.memory.activation_offloading import apply_activation_offloading
from torchtune_ac.memory.feature import MakeOptimizer
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import load_hf_weights_
from torchtune_ac.models.families import parameter_initializer, retie_parameters, transformer_blocks
from torchtune_ac.models.llama import TransformerBlock
from torchtune_ac.models.moe import choose_expert_kernels_
from torchtune_ac.parallel.expert_parallel import apply_expert_parallel
from torchtune_ac.parallel.fsdp import FSDPConfig, parameter_device, shard_model
from torchtune_ac.parallel.tensor_parallel import apply_tensor_parallel
from torchtune_ac.run.plan import RunPlan
from torchtune_ac.run.weights import initialize_weights_
from torchtune_ac.runtime.distributed import DistributedContext, join_world_of_one
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.runtime.parallelism import EP_DIM, TP_DIM, Parallelism
from torchtune_ac.training.dpo import freeze_reference
from torchtune_ac.training.objective import Objective, with_load_balancing
from torchtune_ac.training.step import Stepper


@dataclass(frozen=True)
class AssemblyPlan:
    """What the order applies to a model, for a model assembled outside a run (a benchmark, a test); a run passes
    its ``RunPlan``, which has every field.

    Attributes:
        dtype: the parameters' storage dtype.
        memory: the memory plan (AC, activation offloading, CPU offload, the stepper, the objective).
        fsdp: FSDP2's settings (used when the model is sharded).
        parallelism: how the processes split the work; None: the context's (``DistributedContext.parallelism``).
        compile: ``torch.compile`` each block in place (state_dict keys unchanged).
        adapter: low-rank adapters on the frozen base (``torchtune_ac/lora/``); None: every parameter trains.
        checkpoint_dir: the Hugging Face checkpoint whose weights are loaded; None to initialise from ``seed``.
        seed: seeds the global RNG (dropout) and the initialisation without a checkpoint.
    """

    dtype: DType
    memory: MemoryPlan
    fsdp: FSDPConfig = FSDPConfig()
    parallelism: Optional[Parallelism] = None
    compile: bool = False
    checkpoint_dir: Optional[str] = None
    seed: int = 0
    adapter: Optional[AdapterConfig] = None


Plan = Union[RunPlan, AssemblyPlan]


@dataclass
class AssembledModel:
    """The model to train and what trains it.

    Attributes:
        model: on the run's device, sharded when the plan says so, in training mode.
        stepper: who steps the parameters (``stepper.optimizer`` is what the scheduler drives); None when no
            optimizer was asked for (a model to measure or evaluate).
        objective: what each micro-batch's loss is.
        scheduler: the learning-rate schedule, or None.
    """

    model: nn.Module
    stepper: Optional[Stepper]
    objective: Objective
    scheduler: Optional[Any] = None


def build_mesh(plan: Plan, ctx: DistributedContext) -> Optional[DeviceMesh]:
    """The run's device mesh (``Parallelism.build_mesh``), built once: every model of the run (DPO's reference too)
    is sharded over it, so its process groups are made once. None when the model is not sharded (one process, no
    feature that works through FSDP2); a single process that shards joins a world of one first.
    """
    if not (ctx.is_distributed or plan.memory.shard_options()):
        return None
    join_world_of_one(ctx.device)
    return (plan.parallelism or ctx.parallelism).build_mesh(ctx.device.type)


def build_training(
    model: nn.Module,
    plan: Plan,
    *,
    ctx: DistributedContext,
    mesh: Optional[DeviceMesh] = None,
    load_weights: bool = True,
    make_optimizer: Optional[MakeOptimizer] = None,
    make_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
    objective: Optional[Objective] = None,
    frozen: bool = False,
) -> AssembledModel:
    """Apply ``plan`` to ``model``, in the one order (see the module docstring).

    Args:
        model: the model, built on the meta device (``build_meta_model``), not yet changed.
        plan: the run's plan (or an ``AssemblyPlan``): dtype, memory plan, FSDP2 settings, parallelism, compile,
            the checkpoint to load and the seed.
        ctx: this process: rank, world size, device.
        mesh: the run's mesh (``build_mesh``); None: built here when the model is sharded.
        load_weights: fill the weights; False leaves them for the caller (a resume loads its own).
        make_optimizer: the config's optimizer, called with parameters; None: no stepper.
        make_scheduler: builds the LR schedule over the stepper's optimizer; None: no schedule.
        objective: what each micro-batch's loss is (a recipe's own, DPO's); None: the memory plan's token loss.
        frozen: a model that never trains (DPO's reference, ``build_reference``): no activation checkpointing,
            offloading or compile (nothing is kept for backward), every FSDP2 group resharded after its forward,
            no gradients, eval mode.

    Returns:
        The model in training mode, computing on ``ctx.device`` (its parameters kept on the CPU under CPU
        offload), and what trains it.
    """
    memory, parallelism = plan.memory, plan.parallelism or ctx.parallelism
    # The global RNG, seeded once here: what a custom model's init_weights and dropout draw from (a resume restores
    # its own state later).
    torch.manual_seed(plan.seed)
    options = memory.shard_options()
    if mesh is None:
        mesh = build_mesh(plan, ctx)
    sharded = mesh is not None
    # A model of no family of ours initialises itself whole: when sharded, from an untouched copy on the CPU.
    pristine = (copy.deepcopy(model) if load_weights and plan.checkpoint_dir is None and sharded
                and parameter_initializer(model) is None else None)
    model = model.to(plan.dtype.torch)
    blocks = transformer_blocks(model)

    # 1. Adapters: the chosen linears wrapped with low-rank adapters, everything else frozen (a reference, built
    #    from its own meta model, has none). QLoRA under FSDP2: their base weights in NF4 already, for FSDP2 to shard.
    if plan.adapter is not None and not frozen:
        apply_adapters(model, plan.adapter, loss_chunks=memory.settings.loss_chunks)
        if sharded and plan.adapter.quantize_base is QuantizeBase.NF4:
            store_base_as_nf4_(model, ctx.device)
    # 2. Activation checkpointing: the chosen blocks recompute their activations in backward.
    if not frozen:
        apply_ac_plan(model, memory.ac)
    # 3. Activation offloading: what those blocks keep for backward waits in pinned host memory.
    if memory.offloads_activations and not frozen:
        apply_activation_offloading(model)
    # 4. Compile: each block in place (it traces the checkpointed forward, per-op policy included).
    if plan.compile and not frozen:
        if memory.ac.mode is not ACMode.NONE and all(isinstance(b, TransformerBlock) for b in blocks):
            silence_compiled_policy_warning()
        for block in blocks:
            block.compile()
    # 5. Tensor parallelism: before FSDP2, each block's heads and MLP columns, and the vocabulary, split over the
    #    mesh's "tp" dimension by the family's plan (the run's plan checked the degree).
    if parallelism.tensor_parallel:
        apply_tensor_parallel(model, mesh[TP_DIM])
    # 6. Expert parallelism: before FSDP2, each mixture-of-experts layer's experts split over the mesh's "ep"
    #    dimension, its tokens exchanged by all-to-all (the run's plan checked the degree against the experts).
    if parallelism.expert_parallel:
        apply_expert_parallel(model, mesh[EP_DIM])
    # 7. FSDP2: each block, the family's other groups, then the root, over the mesh's other dimensions; CPU offload
    #    keeps the shards on the host. One process shards too when a feature works through FSDP2 (a world of one);
    #    a TP run is always sharded: FSDP2, even over dimensions of size 1, turns the split layers' partial
    #    gradients of the norms into whole ones.
    if sharded:
        shard_model(model, mesh, plan.fsdp, options, dtype=plan.dtype, frozen=frozen)
    # 8. Materialise: allocate every parameter (this rank's shard) on its device, buffers where the model computes.
    model.to_empty(device=parameter_device(options, ctx.device))
    place_buffers_(model, ctx.device)
    choose_expert_kernels_(model, ctx.device, plan.dtype.torch)  # the experts' matmul, as torch runs it there
    if not sharded:
        retie_parameters(model)  # FSDP keeps ties through to_empty; a plain module does not
    # 9. Load or initialise: the checkpoint's weights (each rank reads only its shard), or drawn from the seed.
    #    A sharded NF4 base is filled dense, then quantised whole (``nf4_from_dense``).
    with base_only(model), nf4_from_dense(model, plan.dtype.torch):  # the base alone: what the checkpoint holds
        if load_weights and plan.checkpoint_dir is not None:
            load_hf_weights_(model, plan.checkpoint_dir)
        elif load_weights:
            initialize_weights_(model, pristine, dtype=plan.dtype.torch, seed=plan.seed, sharded=sharded)
    if load_weights and plan.adapter is not None and not frozen:
        # ...then the adapters: PEFT's values (B zero), or a PEFT folder's; QLoRA's base stored in NF4.
        load_or_initialize_adapters_(model, plan.adapter, seed=plan.seed)
    # The recipe's objective (DPO's) or the memory plan's token loss; a mixture of experts adds its load-balancing
    # loss to either, as transformers' and TRL's trainers do.
    objective = with_load_balancing(objective if objective is not None else memory.objective(compiled=plan.compile),
                                    model)
    if frozen:
        return AssembledModel(freeze_reference(model), None, objective)
    model.train()

    # 10. Optimizer, over the sharded parameters that train (the adapters alone, with adapters), and 11. stepper,
    #     that steps them (after backward, or in it: the optimizer-in-backward switch builds both at once).
    stepper = memory.build_stepper(make_optimizer, model, mesh) if make_optimizer is not None else None
    # 12. Scheduler: the learning-rate schedule over the stepper's optimizer.
    scheduler = make_scheduler(stepper.optimizer) if make_scheduler is not None and stepper is not None else None
    return AssembledModel(model, stepper, objective, scheduler)


def build_reference(model: nn.Module, plan: Plan, *, ctx: DistributedContext, mesh: Optional[DeviceMesh] = None,
                    checkpoint_dir: Optional[str]) -> nn.Module:
    """A frozen reference model (DPO's): ``model`` (a second meta build of the policy's architecture) through the
    one order, ``frozen``: sharded like the policy over the same mesh (the same groups, CPU offload), every group
    resharded after its forward (a group left gathered for a backward that never comes would stay gathered for
    good), loaded from ``checkpoint_dir`` or initialised from the plan's seed as the policy is; no gradients, no
    optimizer, eval mode.

    Args:
        plan: the run's plan (its ``fully_shard`` options: CPU offload).
        checkpoint_dir: the reference's weights (``ref_checkpoint_dir``, else the policy's ``checkpoint_dir``);
            None: the seed's random ones, the policy's own.
    """
    reference_plan = AssemblyPlan(plan.dtype, plan.memory, plan.fsdp, plan.parallelism, compile=False,
                                  checkpoint_dir=checkpoint_dir, seed=plan.seed)
    return build_training(model, reference_plan, ctx=ctx, mesh=mesh, frozen=True).model


def place_buffers_(built: nn.Module, device: torch.device) -> None:
    """Put ``built``'s buffers (RoPE's frequencies) on the device that computes, where ``to_empty`` put them beside
    parameters kept on the host (CPU offload: FSDP2 manages the parameters, not the buffers, and a forward on
    the GPU must find them there)."""
    for module in built.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))
