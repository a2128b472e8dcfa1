"""Build the model to train, in the one order that works for 1 and N processes.

    build on the meta device -> cast to the storage dtype -> the memory switches that change the model
    (activation checkpointing) -> compile (optional)
    -> FSDP2 per block, then the family's other groups, then root, over a mesh of the run's device (N > 1, or
       one process when a memory switch works through FSDP2: CPU offload)
    -> allocate on the device -> load Hugging Face weights (each rank reads only its own shard) or initialise
    from the seed (one parameter at a time, each from a CPU generator of its own; each rank keeps its shard).

AC comes first so that compile traces each checkpointed forward (per-op policy included) and the FSDP hooks
wrap the checkpointed blocks; nothing is materialised before sharding, so no rank ever holds the full model,
and the initial weights are the same for any world size and device.
The model's family (``torchtune_ac.models.families``) says which modules are its blocks and how it initialises.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import local_region
from torchtune_ac.config.meta_model import ModelBuilder, build_meta_model
from torchtune_ac.memory.activation_checkpointing import silence_compiled_policy_warning
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import load_hf_weights_
from torchtune_ac.models.families import (
    init_weights_,
    parameter_initializer,
    retie_parameters,
    transformer_blocks,
)
from torchtune_ac.models.llama import TransformerBlock
from torchtune_ac.runtime.distributed import (
    DistributedContext,
    FSDPConfig,
    join_world_of_one,
    parameter_device,
    shard_model,
)
from torchtune_ac.runtime.dtypes import DType


def build_training_model(
    model: ModelBuilder,
    *,
    ctx: DistributedContext,
    dtype: DType,
    memory: MemoryPlan,
    fsdp: FSDPConfig,
    compile_blocks: bool,
    checkpoint_dir: Optional[str],
    load_weights: bool = True,
    seed: int,
) -> nn.Module:
    """Build, checkpoint, shard and load the model (see the module docstring for the order).

    Args:
        model: the ``model`` config component.
        ctx: rank, world size and device.
        dtype: storage dtype of parameters.
        memory: the memory plan: every switch that changes the model (activation checkpointing) is applied
            before compile and sharding.
        fsdp: FSDP2 settings (used when the model is sharded).
        compile_blocks: ``torch.compile`` each block in place (state_dict keys unchanged).
        checkpoint_dir: the run's Hugging Face checkpoint: the weights when ``load_weights``, and the config.json
            of ``from_hf_config``; None to initialise from ``seed``.
        load_weights: fill the weights (from ``checkpoint_dir`` or ``seed``); False leaves them unset for the
            caller to load (resuming from recipe state).
        seed: seed for initialisation when there is no checkpoint.

    Returns:
        The model in training mode, computing on ``ctx.device`` (its parameters kept on the CPU when a switch
        offloads them there).
    """
    built = build_meta_model(model, checkpoint_dir).to(dtype.torch)
    blocks = transformer_blocks(built)
    memory.apply_to_model(built)
    if compile_blocks:
        if memory.ac.policy is not None and all(isinstance(b, TransformerBlock) for b in blocks):
            silence_compiled_policy_warning()
        for block in blocks:
            block.compile()
    options = memory.shard_options()
    sharded = ctx.is_distributed or bool(options)
    if sharded:
        join_world_of_one(ctx.device)  # a single process shards on a world of one
        shard_model(built, fsdp, options, device=ctx.device, dtype=dtype)
    built.to_empty(device=parameter_device(options, ctx.device))
    place_buffers_(built, ctx.device)
    if not sharded:
        retie_parameters(built)  # FSDP keeps ties through to_empty; a plain module does not
    if load_weights and checkpoint_dir is not None:
        load_hf_weights_(built, checkpoint_dir)
    elif load_weights:
        initialize_weights_(built, model, dtype=dtype.torch, seed=seed, sharded=sharded)
    built.train()
    return built


def place_buffers_(built: nn.Module, device: torch.device) -> None:
    """Put ``built``'s buffers (RoPE's frequencies) on the device that computes, where ``to_empty`` put them beside
    parameters kept on the host (CPU offload: FSDP2 manages the parameters, not the buffers, and a forward on
    the GPU must find them there)."""
    for module in built.modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.device != device:
                setattr(module, name, buffer.to(device))


@torch.no_grad()
def initialize_weights_(built: nn.Module, model: ModelBuilder, *, dtype: torch.dtype, seed: int, sharded: bool) -> None:
    """Initialise ``built`` (allocated on its device, sharded or not) from ``seed``: the same weights for any world
    size and any device.

    One parameter at a time, each full tensor is drawn on the CPU from a generator of its own, seeded from
    ``seed`` and the parameter's name (``parameter_seed``), and only this rank's region of it is copied to the
    device. Neither the device's generator nor the order of the draws depends on where the model runs or how it
    is sharded, and no rank ever holds more than one full parameter on the host (the largest, e.g. the
    embedding).

    A custom model (of no known family) without ``init_parameter_(name, tensor, generator)`` initialises itself
    with ``init_weights()`` under the seeded global RNG: when sharded, from a full copy on the CPU (the model's
    size in host memory; give it ``init_parameter_`` or start from a checkpoint).

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
    full_model = build_meta_model(model).to(dtype)
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
