"""A run's initial weights without a checkpoint: the same for any world size, sharding and device.

Each parameter of a known family is drawn in blocks of rows on the CPU, each block from a generator of its own
seeded from the run's seed, the parameter's name and the block's index; each rank draws only the blocks over its
shard. ``run/assemble.py`` calls ``initialize_weights_`` as the last step of its order when no weights are loaded.
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
from torchtune_ac.models.families import family_of, init_weights_, parameter_initializer, retie_parameters


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
