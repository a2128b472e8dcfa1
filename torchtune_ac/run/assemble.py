"""The order in which a run applies its plan to the model, in one function: ``build_training``.

    activation checkpointing -> activation offloading -> compile -> [tensor parallelism] -> FSDP2 (CPU offload)
    -> materialise -> load or initialise;  then optimizer -> stepper -> scheduler

Every step is a mechanism of its own module, called here by name (the memory features' are in ``memory/``, AC's and
FSDP2's in ``training/``). The order is the one that works for 1 and N processes: AC first, so that compile traces
each checkpointed forward (per-op policy included) and FSDP2's hooks wrap the checkpointed blocks; nothing is
materialised before sharding, so no rank ever holds the full model, and the initial weights are the same for any
world size and device (each parameter drawn on the CPU from a generator of its own). The optimizer comes after
FSDP2: it steps the sharded parameters, and the step in backward hooks them.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import local_region
from torchtune_ac.memory.activation_offloading import apply_activation_offloading
from torchtune_ac.memory.feature import MakeOptimizer
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import load_hf_weights_
from torchtune_ac.models.families import init_weights_, parameter_initializer, retie_parameters, transformer_blocks
from torchtune_ac.models.llama import TransformerBlock
from torchtune_ac.runtime.distributed import DistributedContext, FSDPConfig, join_world_of_one
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.training.activation_checkpointing import apply_ac_plan, silence_compiled_policy_warning
from torchtune_ac.training.fsdp import parameter_device, shard_model
from torchtune_ac.training.objective import Objective
from torchtune_ac.training.step import Stepper


@dataclass
class Training:
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


def build_training(
    model: nn.Module,
    *,
    ctx: DistributedContext,
    dtype: DType,
    memory: MemoryPlan,
    fsdp: FSDPConfig,
    compile_blocks: bool,
    checkpoint_dir: Optional[str],
    seed: int,
    load_weights: bool = True,
    make_optimizer: Optional[MakeOptimizer] = None,
    make_scheduler: Optional[Callable[[torch.optim.Optimizer], Any]] = None,
) -> Training:
    """Apply the plan to ``model``, in the one order (see the module docstring).

    Args:
        model: the model, built on the meta device (``build_meta_model``), not yet changed.
        ctx: this process: rank, world size, device.
        dtype: the parameters' storage dtype.
        memory: the memory plan (AC, activation offloading, CPU offload, the stepper, the objective).
        fsdp: FSDP2's settings (used when the model is sharded).
        compile_blocks: ``torch.compile`` each block in place (state_dict keys unchanged).
        checkpoint_dir: the Hugging Face checkpoint whose weights are loaded; None to initialise from ``seed``.
        seed: seeds the initialisation without a checkpoint.
        load_weights: fill the weights; False leaves them for the caller (a resume loads its own).
        make_optimizer: the config's optimizer, called with parameters; None: no stepper.
        make_scheduler: builds the LR schedule over the stepper's optimizer; None: no schedule.

    Returns:
        The model in training mode, computing on ``ctx.device`` (its parameters kept on the CPU under CPU
        offload), and what trains it.
    """
    options = memory.shard_options()
    sharded = ctx.is_distributed or bool(options)
    # A model of no family of ours initialises itself whole: when sharded, from an untouched copy on the CPU.
    pristine = (copy.deepcopy(model) if load_weights and checkpoint_dir is None and sharded
                and parameter_initializer(model) is None else None)
    model = model.to(dtype.torch)
    blocks = transformer_blocks(model)

    # 1. Activation checkpointing: the chosen blocks recompute their activations in backward.
    apply_ac_plan(model, memory.ac)
    # 2. Activation offloading: what those blocks keep for backward waits in pinned host memory.
    if memory.offloads_activations:
        apply_activation_offloading(model)
    # 3. Compile each block in place (it traces the checkpointed forward, per-op policy included).
    if compile_blocks:
        if memory.ac.policy is not None and all(isinstance(b, TransformerBlock) for b in blocks):
            silence_compiled_policy_warning()
        for block in blocks:
            block.compile()
    # -- Tensor parallelism goes here, before FSDP2: each block's linear layers split over the mesh's "tp"
    #    dimension, the data-parallel dimension left to FSDP2. (Not yet: FSDP2 shards over every process.)
    # 4. FSDP2: each block, the family's other groups, then the root; CPU offload keeps the shards on the host.
    #    One process shards too when a feature works through FSDP2 (a world of one).
    if sharded:
        join_world_of_one(ctx.device)
        shard_model(model, fsdp, options, device=ctx.device, dtype=dtype)
    # 5. Materialise: allocate every parameter (this rank's shard) on its device, buffers where the model computes.
    model.to_empty(device=parameter_device(options, ctx.device))
    place_buffers_(model, ctx.device)
    if not sharded:
        retie_parameters(model)  # FSDP keeps ties through to_empty; a plain module does not
    # 6. Load the checkpoint's weights (each rank reads only its shard), or initialise them from the seed.
    if load_weights and checkpoint_dir is not None:
        load_hf_weights_(model, checkpoint_dir)
    elif load_weights:
        initialize_weights_(model, pristine, dtype=dtype.torch, seed=seed, sharded=sharded)
    model.train()

    # 7. The optimizer, over the sharded parameters; 8. the stepper that steps them (after backward, or in it);
    # 9. the learning-rate schedule over the stepper's optimizer.
    stepper = memory.build_stepper(make_optimizer, model) if make_optimizer is not None else None
    scheduler = make_scheduler(stepper.optimizer) if make_scheduler is not None and stepper is not None else None
    return Training(model, stepper, memory.objective(), scheduler)


def place_buffers_(built: nn.Module, device: torch.device) -> None:
    """Put ``built``'s buffers (RoPE's frequencies) on the device that computes, where ``to_empty`` put them beside
    parameters kept on the host (CPU offload: FSDP2 manages the parameters, not the buffers, and a forward on
    the GPU must find them there)."""
    for module in built.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))


@torch.no_grad()
def initialize_weights_(built: nn.Module, pristine: Optional[nn.Module], *, dtype: torch.dtype, seed: int,
                        sharded: bool) -> None:
    """Initialise ``built`` (allocated on its device, sharded or not) from ``seed``: the same weights for any world
    size and any device.

    One parameter at a time, each full tensor is drawn on the CPU from a generator of its own, seeded from
    ``seed`` and the parameter's name (``parameter_seed``), and only this rank's region of it is copied to the
    device. Neither the device's generator nor the order of the draws depends on where the model runs or how it
    is sharded, and no rank ever holds more than one full parameter on the host (the largest, e.g. the
    embedding).

    A custom model (of no known family) without ``init_parameter_(name, tensor, generator)`` initialises itself
    with ``init_weights()`` under the seeded global RNG: when sharded, from a full copy on the CPU (``pristine``:
    the model as built on the meta device; the model's size in host memory; give it ``init_parameter_`` or start
    from a checkpoint).

    Raises:
        UserError: a custom model with neither ``init_parameter_()`` nor ``init_weights()``.
    """
    init_parameter = parameter_initializer(built)
    if init_parameter is not None:
        for name, param in built.named_parameters():  # a tied parameter once
            full = torch.empty(param.shape, dtype=param.dtype, device="cpu")
            init_parameter(name, full, torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name)))
            local, region = local_region(param)
            local.copy_(full[region])
            del full  # before the next parameter's: one full parameter at a time
        return
    torch.manual_seed(seed)
    if not sharded:
        init_weights_(built)
        return
    full_model = pristine.to(dtype)
    full_model.to_empty(device="cpu")
    retie_parameters(full_model)
    init_weights_(full_model)
    full_params = dict(full_model.named_parameters())
    for name, param in built.named_parameters():
        local, region = local_region(param)
        local.copy_(full_params[name][region])


def parameter_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: a stable hash of the run's seed and the name (the same in every
    process, unlike Python's ``hash``)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
