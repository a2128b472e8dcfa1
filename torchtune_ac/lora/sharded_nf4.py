"""QLoRA under FSDP2: the adapted linears' base weights stored as torchao's ``NF4Tensor`` before ``fully_shard``
(``store_base_as_nf4_``, on the meta model), which torchao's NF4 lets FSDP2 split by rows and all-gather (its
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), as torchtune's QLoRA did; and their values
(``nf4_from_dense``): each weight loaded dense, quantised whole, then this rank's rows of that one quantisation
kept, so every rank gathers the weight one process would have quantised (NF4 quantises its block scales around
their mean over the whole tensor: a shard quantised alone would not match).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from torchtune_ac.errors import UserError
from torchtune_ac.lora.mechanism import NF4_BLOCK, NF4_SCALER_BLOCK, adapted_linears


def check_nf4_sharding(targets: dict[str, nn.Linear], shard_degree: int) -> None:
    """Refuse a shard degree that cannot split an adapted linear's NF4 weight: torchao splits an ``NF4Tensor`` by
    rows into equal shards of whole blocks (each shard a multiple of 64 x 256 weights).

    Raises:
        UserError: one line naming the first linear that cannot be split.
    """
    for name, linear in targets.items():
        rows, columns = linear.weight.shape
        if rows % shard_degree or (rows // shard_degree * columns) % (NF4_BLOCK * NF4_SCALER_BLOCK):
            raise UserError(f"adapter.quantize_base=nf4 over {shard_degree} processes: {name}.weight "
                            f"{tuple(linear.weight.shape)} does not split by rows into {shard_degree} shards of whole "
                            f"NF4 blocks ({NF4_BLOCK} x {NF4_SCALER_BLOCK} weights each); drop its name from "
                            "adapter.targets, use fewer processes, or set adapter.quantize_base: null")


@torch.no_grad()
def store_base_as_nf4_(model: nn.Module, device: torch.device) -> None:
    """Each adapted linear's base weight (on meta, before ``fully_shard``) replaced by an ``NF4Tensor`` of its shape,
    frozen: what FSDP2 then shards. Its two unsharded tensors (the scales' mean, the 16 code values), which
    ``to_empty`` does not allocate and every shard shares, are allocated on ``device`` now."""
    from torchao.quantization import to_nf4

    for _, linear in adapted_linears(model):
        nf4 = to_nf4(linear.weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK)
        nf4.scaler_mean = torch.empty_like(nf4.scaler_mean, device=device)
        nf4.nf4 = torch.empty_like(nf4.nf4, device=device)
        linear.weight = nn.Parameter(nf4, requires_grad=False)


def is_sharded_nf4(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a DTensor whose shard is an ``NF4Tensor``."""
    return hasattr(weight, "to_local") and hasattr(weight.to_local(), "get_original_weight")


@contextlib.contextmanager
def nf4_from_dense(model: nn.Module, dtype: torch.dtype) -> Iterator[nn.Module]:
    """Inside the block, each sharded NF4 base weight of ``model`` is a dense DTensor in ``dtype`` of the same
    rows (what a checkpoint's loader or the initialisation fills); on leaving it, each is gathered, quantised
    whole and this rank's rows of that quantisation become its NF4 shard (see the module docstring). A
    weight's dense copy lives until the block ends (the base in ``dtype``, sharded, as a LoRA run holds it)."""
    from torch.distributed.tensor import DTensor

    swapped = []
    for _, linear in adapted_linears(model):
        weight = linear.weight
        if not is_sharded_nf4(weight):
            continue
        local = torch.empty(weight.to_local().shape, dtype=dtype, device=weight.device)
        dense = DTensor.from_local(local, weight.device_mesh, weight.placements, shape=weight.shape,
                                   stride=weight.stride())
        linear._parameters["weight"] = nn.Parameter(dense, requires_grad=False)
        swapped.append((linear, weight))
    try:
        yield model
    except BaseException:
        for linear, weight in swapped:
            linear._parameters["weight"] = weight
        raise
    with torch.no_grad():
        _quantize_whole_(swapped)


def _quantize_whole_(swapped: list) -> None:
    """Each (linear, its NF4 weight) of ``swapped``: the dense weight in its place quantised whole, this rank's rows
    of it copied into the NF4 shard, and the NF4 weight put back."""
    from torchao.quantization import to_nf4

    for linear, weight in swapped:
        dense = linear._parameters["weight"]
        linear._parameters["weight"] = weight
        mesh = weight.device_mesh
        quantised = to_nf4(dense.full_tensor(), NF4_BLOCK, NF4_SCALER_BLOCK)
        rows = torch.chunk(quantised, mesh.size(), dim=0)[mesh.get_local_rank()]
        # The same layout: NF4's copy_ copies each inner tensor in place (the mean and code values too, shared).
        weight.to_local().copy_(rows)
