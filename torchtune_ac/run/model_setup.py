"""Build the model to train, in the one order that works for 1 and N processes.

    build on the meta device -> cast to the storage dtype -> the memory switches that change the model
    (activation checkpointing) -> compile (optional)
    -> FSDP2 per block, then the family's other groups, then root, over a mesh of the run's device (N > 1, or
       one process when a memory switch works through FSDP2: CPU offload)
    -> allocate on the device -> load Hugging Face weights (each rank reads only its own shard) or initialise
    from the seed (in blocks of rows, each from a CPU generator of its own; each rank draws its own rows).

AC comes first so that compile traces each checkpointed forward (per-op policy included) and the FSDP hooks
wrap the checkpointed blocks; nothing is materialised before sharding, so no rank ever holds the full model,
and the initial weights are the same for any world size and device.
The model's family (``torchtune_ac.models.families``) says which modules are its blocks and how it initialises.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import local_region
from torchtune_ac.config.meta_model import ModelBuilder, build_meta_model
from torchtune_ac.memory.activation_checkpointing import silence_compiled_policy_warning
from torchtune_ac.memory.plan import MemoryPlan
from torchtune_ac.models import load_hf_weights_
from torchtune_ac.models.families import (
    family_of,
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


# Rows of a parameter drawn from one generator (a block): the blocks depend on the parameter's shape alone, so the
# values are the same for any sharding; small enough that a rank draws little beyond its own rows, and many enough
# to share the drawing among threads (a CPU generator draws serially: one 262 M-element embedding took 28 s in
# bf16 on torch 2.11).
INIT_BLOCK_ELEMENTS = 1 << 22


@torch.no_grad()
def initialize_weights_(built: nn.Module, model: ModelBuilder, *, dtype: torch.dtype, seed: int, sharded: bool) -> None:
    """Initialise ``built`` (allocated on its device, sharded or not) from ``seed``: the same weights for any world
    size and any device.

    A model of a known family is drawn in blocks of rows (``INIT_BLOCK_ELEMENTS``), each on the CPU from a
    generator of its own, seeded from ``seed``, the parameter's name and the block's index (``parameter_seed``);
    a rank draws only the blocks that overlap its shard and copies its rows of them to the device. Neither the
    device's generator nor the order of the draws depends on where the model runs or how it is sharded, so the
    blocks are drawn on a pool of threads. Low-precision parameters are drawn in float32 and rounded once (bf16
    ``normal_`` on the CPU is serial and several times slower). A custom model's ``init_parameter_(name, tensor,
    generator)`` is given each parameter whole (its rule may depend on the full shape), one generator each.

    A custom model without ``init_parameter_`` initialises itself with ``init_weights()`` under the seeded
    global RNG: when sharded, from a full copy on the CPU (the model's size in host memory; give it
    ``init_parameter_`` or start from a checkpoint).

    Raises:
        UserError: a custom model with neither ``init_parameter_()`` nor ``init_weights()``.
    """
    init_parameter = parameter_initializer(built)
    if init_parameter is not None:
        block_elements = INIT_BLOCK_ELEMENTS if family_of(built) is not None else None
        draws = [draw for name, param in built.named_parameters()  # a tied parameter once
                 for draw in _block_draws(name, param, init_parameter, seed, block_elements)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(draws), os.cpu_count() or 1))) as pool:
            for _ in pool.map(lambda draw: draw(), draws):
                pass
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


def _block_draws(name: str, param: torch.Tensor, init_parameter: Callable[[str, torch.Tensor, torch.Generator], None],
                 seed: int, block_elements: Optional[int]) -> list[Callable[[], None]]:
    """The draws that fill this rank's part of ``param``: one per block of rows overlapping its shard (the whole
    parameter one block when ``block_elements`` is None)."""
    local, region = local_region(param)
    draw_dtype = torch.float32 if param.dtype.is_floating_point and param.dtype.itemsize < 4 else param.dtype
    if param.dim() == 0:
        @torch.no_grad()  # grad mode is per thread: the pool's threads do not inherit the caller's
        def draw_scalar() -> None:
            values = torch.empty((), dtype=draw_dtype)
            init_parameter(name, values, torch.Generator().manual_seed(parameter_seed(seed, name)))
            local.copy_(values)

        return [draw_scalar]
    rows, row_shape = param.shape[0], tuple(param.shape[1:])
    block_rows = rows if block_elements is None else max(1, block_elements // max(1, math.prod(row_shape)))
    first, last = region[0].start, region[0].stop  # this rank's rows

    @torch.no_grad()
    def draw(block: int) -> None:
        start, stop = block * block_rows, min(rows, (block + 1) * block_rows)
        values = torch.empty((stop - start, *row_shape), dtype=draw_dtype)  # [block rows, ...]
        init_parameter(name, values, torch.Generator().manual_seed(parameter_seed(seed, name, block)))
        low, high = max(start, first), min(stop, last)
        local[low - first:high - first].copy_(values[(slice(low - start, high - start), *region[1:])])

    if last <= first:  # an uneven shard with no rows here
        return []
    return [functools.partial(draw, block) for block in range(first // block_rows, math.ceil(last / block_rows))]


def parameter_seed(seed: int, name: str, block: int = 0) -> int:
    """The seed of the generator of block ``block`` of parameter ``name``: a stable hash of the run's seed, the
    name and the block (the same in every process, unlike Python's ``hash``). The first block's is the seed's and
    the name's alone, so a parameter of one block is drawn as from a generator of its own."""
    key = f"{seed}:{name}" if block == 0 else f"{seed}:{name}:{block}"
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
