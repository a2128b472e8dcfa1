"""The order in which a run applies its plan to the model, in one function: ``build_training``.

    activation checkpointing -> activation offloading -> compile -> tensor parallelism -> FSDP2 (CPU offload)
    -> materialise -> load or initialise;  then optimizer -> stepper -> scheduler

Every step is a mechanism of its own module, called here by name (the memory features' are in ``memory/``, AC's and
FSDP2's in ``training/``). The order is the one that works for 1 and N processes: AC first, so that compile traces
each checkpointed forward (per-op policy included) and FSDP2's hooks wrap the checkpointed blocks; nothing is
materialised before sharding, so no rank ever holds the full model, and the initial weights are the same for any
world size and device (drawn on the CPU in blocks of rows, each from a generator of its own; each rank draws its
own rows). The optimizer comes after
FSDP2: it steps the sharded parameters, and the step in backward hooks them.

``build_reference`` runs the same order for a model that never trains (DPO's reference): no AC, offloading or
compile, every FSDP2 group resharded after its forward, no optimizer, frozen.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchtune_ac.checkpoint import local_region
from torchtune_ac.memory.activation_offloading import apply_activation_offloading
from torchtune_ac.memory.feature import MakeOptimizer
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
    TP_DIM,
    DistributedContext,
    FSDPConfig,
    build_device_mesh,
    join_world_of_one,
)
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.training.activation_checkpointing import apply_ac_plan, silence_compiled_policy_warning
from torchtune_ac.training.fsdp import parameter_device, shard_model
from torchtune_ac.training.dpo import freeze_reference
from torchtune_ac.training.objective import Objective, with_load_balancing
from torchtune_ac.training.step import Stepper
from torchtune_ac.training.tensor_parallel import apply_tensor_parallel


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
    frozen: bool = False,
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
        seed: seeds the global RNG (dropout) and the initialisation without a checkpoint.
        load_weights: fill the weights; False leaves them for the caller (a resume loads its own).
        make_optimizer: the config's optimizer, called with parameters; None: no stepper.
        make_scheduler: builds the LR schedule over the stepper's optimizer; None: no schedule.
        frozen: a model that never trains (DPO's reference, ``build_reference``): no activation checkpointing,
            offloading or compile (nothing is kept for backward), every FSDP2 group resharded after its forward,
            no gradients, eval mode.

    Returns:
        The model in training mode, computing on ``ctx.device`` (its parameters kept on the CPU under CPU
        offload), and what trains it.
    """
    # The global RNG, seeded once here: what a custom model's init_weights and dropout draw from (a resume restores
    # its own state later).
    torch.manual_seed(seed)
    options = memory.shard_options()
    sharded = ctx.is_distributed or bool(options)
    # A model of no family of ours initialises itself whole: when sharded, from an untouched copy on the CPU.
    pristine = (copy.deepcopy(model) if load_weights and checkpoint_dir is None and sharded
                and parameter_initializer(model) is None else None)
    model = model.to(dtype.torch)
    blocks = transformer_blocks(model)

    # 1. Activation checkpointing: the chosen blocks recompute their activations in backward.
    if not frozen:
        apply_ac_plan(model, memory.ac)
    # 2. Activation offloading: what those blocks keep for backward waits in pinned host memory.
    if memory.offloads_activations and not frozen:
        apply_activation_offloading(model)
    # 3. Compile each block in place (it traces the checkpointed forward, per-op policy included).
    if compile_blocks and not frozen:
        if memory.ac.policy is not None and all(isinstance(b, TransformerBlock) for b in blocks):
            silence_compiled_policy_warning()
        for block in blocks:
            block.compile()
    # 4. Tensor parallelism, before FSDP2: the mesh (replicate, shard, tp) is built once; each block's heads and
    #    MLP columns, and the vocabulary, split over its "tp" dimension by the family's plan (the plan checked the
    #    degree). A TP run is always sharded: FSDP2 over the other dimensions, even of size 1, turns the split
    #    layers' partial gradients of the norms into whole ones.
    mesh = None
    if ctx.tp_degree > 1:
        mesh = build_device_mesh(ctx.device.type, ctx.world_size, fsdp.replicate_degree, ctx.tp_degree)
        apply_tensor_parallel(model, mesh[TP_DIM])
    # 5. FSDP2: each block, the family's other groups, then the root; CPU offload keeps the shards on the host.
    #    One process shards too when a feature works through FSDP2 (a world of one).
    if sharded:
        join_world_of_one(ctx.device)
        shard_model(model, fsdp, options, device=ctx.device, dtype=dtype, frozen=frozen, mesh=mesh)
    # 6. Materialise: allocate every parameter (this rank's shard) on its device, buffers where the model computes.
    model.to_empty(device=parameter_device(options, ctx.device))
    place_buffers_(model, ctx.device)
    if not sharded:
        retie_parameters(model)  # FSDP keeps ties through to_empty; a plain module does not
    # 7. Load the checkpoint's weights (each rank reads only its shard), or initialise them from the seed.
    if load_weights and checkpoint_dir is not None:
        load_hf_weights_(model, checkpoint_dir)
    elif load_weights:
        initialize_weights_(model, pristine, dtype=dtype.torch, seed=seed, sharded=sharded)
    if frozen:
        return Training(freeze_reference(model), None, memory.objective())
    model.train()

    # 8. The optimizer, over the sharded parameters; 9. the stepper that steps them (after backward, or in it);
    # 10. the learning-rate schedule over the stepper's optimizer.
    stepper = memory.build_stepper(make_optimizer, model) if make_optimizer is not None else None
    scheduler = make_scheduler(stepper.optimizer) if make_scheduler is not None and stepper is not None else None
    return Training(model, stepper, with_load_balancing(memory.objective(), model), scheduler)


def build_reference(model: nn.Module, *, ctx: DistributedContext, dtype: DType, memory: MemoryPlan,
                    fsdp: FSDPConfig, checkpoint_dir: Optional[str], seed: int) -> nn.Module:
    """A frozen reference model (DPO's): ``model`` (a second meta build of the policy's architecture) through the
    one order, ``frozen``: sharded like the policy (the same groups, CPU offload), every group resharded after its
    forward (a group left gathered for a backward that never comes would stay gathered for good), loaded from
    ``checkpoint_dir`` or initialised from ``seed`` as the policy is; no gradients, no optimizer, eval mode.

    Args:
        memory: the run's memory plan (its ``fully_shard`` options: CPU offload).
        checkpoint_dir: the reference's weights (``ref_checkpoint_dir``, else the policy's ``checkpoint_dir``);
            None: the seed's random ones, the policy's own.
    """
    return build_training(model, ctx=ctx, dtype=dtype, memory=memory, fsdp=fsdp, compile_blocks=False,
                          checkpoint_dir=checkpoint_dir, seed=seed, frozen=True).model


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
def initialize_weights_(built: nn.Module, pristine: Optional[nn.Module], *, dtype: torch.dtype, seed: int,
                        sharded: bool) -> None:
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
    global RNG: when sharded, from a full copy on the CPU (``pristine``: the model as built on the meta device; the
    model's size in host memory; give it ``init_parameter_`` or start from a checkpoint).

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
    full_model = pristine.to(dtype)
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
