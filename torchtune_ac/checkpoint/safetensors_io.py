"""Safetensors files: headers, per-rank regions, and writing a state dict one shard at a time.

Only safetensors files are ever read (never pickles). Headers are read first, so names, shapes and dtypes can
be checked before any data is copied; a process holding a DTensor shard reads only its own region of each
tensor (``safe_open(...).get_slice``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtune_ac.checkpoint.files import read_json, write_json
from torchtune_ac.checkpoint.layout import Region, StoredTensor
from torchtune_ac.errors import UnavailableError, UserError

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def open_safetensors(path: Path):
    """``safe_open`` on CPU, with a one-line ``UserError`` for a truncated or corrupt file."""
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from None


def _read_headers(path: Path) -> dict[str, StoredTensor]:
    with open_safetensors(path) as f:
        out = {}
        for name in f.keys():
            part = f.get_slice(name)
            out[name] = StoredTensor(path, name, tuple(part.get_shape()), part.get_dtype())
        return out


def list_stored_tensors(checkpoint_dir: Path) -> dict[str, StoredTensor]:
    """Every tensor of a checkpoint directory (name -> file, shape, dtype), from the headers only.

    A single ``model.safetensors`` wins over an index, as in transformers.

    Raises:
        UnavailableError: no weights at all (not on this machine).
        UserError: only pickled weights (named, never loaded, with how to convert them), a malformed index, an
            index naming a missing file or a tensor its file lacks, or an unreadable file.
    """
    single, index = checkpoint_dir / WEIGHTS_FILE, checkpoint_dir / INDEX_FILE
    if single.is_file():
        return _read_headers(single)
    if not index.is_file():
        bins = sorted(p.name for p in checkpoint_dir.glob("*.bin"))
        pickles = bins + sorted(p.name for p in checkpoint_dir.glob("*.pt")) + sorted(
            p.name for p in checkpoint_dir.glob("*.pth"))
        expected = f"{checkpoint_dir}: no weights: expected {WEIGHTS_FILE} or {INDEX_FILE}"
        if not pickles:  # the weights are not here (a folder of config.json alone, or still being copied)
            raise UnavailableError(expected)
        convert = (f"convert them once, if you trust them (unpickling can run code): AutoModelForCausalLM."
                   f"from_pretrained('{checkpoint_dir}').save_pretrained('{checkpoint_dir}') writes safetensors; "
                   "or download the model's safetensors files" if bins else
                   "download the model's Hugging Face version (config.json and *.safetensors)")
        raise UserError(f"{expected} (found {', '.join(pickles)}: pickled weights are never loaded); {convert}")
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{index}: expected an object with a 'weight_map' of tensor name -> file name")
    headers: dict[str, dict[str, StoredTensor]] = {}
    for file_name in sorted(set(weight_map.values())):
        shard = checkpoint_dir / file_name
        if not shard.is_file():
            tensor = next(n for n, f in weight_map.items() if f == file_name)
            raise UserError(f"{index}: names shard {file_name} (for {tensor}), but {shard} does not exist")
        headers[file_name] = _read_headers(shard)
    stored = {}
    for name, file_name in weight_map.items():
        if name not in headers[file_name]:
            raise UserError(f"{index}: says {name} is in {file_name}, but that file has no such tensor")
        stored[name] = headers[file_name][name]
    return stored


def local_region(target: torch.Tensor) -> tuple[torch.Tensor, Region]:
    """The tensor this process writes into, and which region of the full tensor it holds.

    A DTensor (e.g. sharded by FSDP2 on dim 0) holds only its own rows; a plain tensor holds everything.
    """
    if isinstance(target, DTensor):
        local_shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        region = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        return target.to_local(), region
    return target, tuple(slice(0, n) for n in target.shape)


def read_region(f, name: str, region: Region) -> torch.Tensor:
    """``region`` of tensor ``name`` from an open safetensors file (only those bytes are read)."""
    if not region:  # a 0-d tensor cannot be sliced
        return f.get_tensor(name)
    return f.get_slice(name)[region]


def parse_shard_size(size: int | str) -> int:
    """Bytes from ``5000000``, ``"5GB"`` (10**9) or ``"500MiB"`` (2**20), as transformers reads them, except
    that units are case-insensitive: ``"5Gb"`` is 5 GB here, where transformers reads a lowercase b as bits.

    Raises:
        UserError: not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(size), flags=re.IGNORECASE)
        unit = (match.group(2) or "").upper() if match else None
        value = int(float(match.group(1)) * _SIZE_UNITS[unit]) if match else 0
    if value <= 0:
        raise UserError(
            f"max_shard_size={size!r}: expected a positive number of bytes or a size like '5GB' or '500MiB'"
        )
    return value


def plan_shards(nbytes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Split names (in order) into shards of at most ``max_bytes``; a tensor larger than the limit gets a
    shard of its own (as transformers does)."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in nbytes.items():
        if current and current_bytes + size > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def write_safetensors(
    out_dir: Path, nbytes: dict[str, int], max_bytes: int, fetch: Callable[[list[str]], dict[str, torch.Tensor]]
) -> None:
    """Write tensors (``nbytes``: name -> size, in order) as ``model.safetensors``, or as numbered shards plus
    ``model.safetensors.index.json`` when they exceed ``max_bytes``.

    ``fetch(names)`` returns the CPU tensors of one shard; it is called once per shard, in order, and its tensors
    are dropped once that shard is written, so at most one shard is held at a time.
    """
    shards = plan_shards(nbytes, max_bytes)
    if len(shards) == 1:
        save_file(fetch(shards[0]), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(shards, start=1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(fetch(names), str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
    write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map})
