"""PEFT adapter folders: ``adapter_model.safetensors`` and ``adapter_config.json``, as ``PeftModel.save_pretrained``
writes them and ``PeftModel.from_pretrained`` reads them; the names and the config's keys come from the caller
(``torchtune_ac/lora/peft_names.py``), the files and the gathers are here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from torchtune_ac.checkpoint.files import leads, read_json, write_json
from torchtune_ac.errors import UserError
from torchtune_ac.runtime.distributed import DistributedContext

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True)
class AdapterFiles:
    """What a PEFT adapter folder holds, before it is written.

    Attributes:
        tensors: PEFT's tensor name -> the tensor (plain, or a DTensor of a sharded model).
        config: adapter_config.json.
    """

    tensors: Mapping[str, torch.Tensor]
    config: Mapping[str, Any]


def write_adapter_files(files: AdapterFiles, out_dir: Path, *,
                        processes: Optional[DistributedContext] = None) -> None:
    """Write ``files`` into ``out_dir`` (every rank calls this: each DTensor is gathered, in name order, and rank 0
    writes). Adapters are small: rank 0 holds them all whole at once."""
    whole = {}
    for name in sorted(files.tensors):
        tensor = files.tensors[name].detach()
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        whole[name] = tensor.to("cpu").contiguous()
    if leads(processes):
        save_file(whole, str(out_dir / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        write_json(out_dir / ADAPTER_CONFIG_FILE, dict(files.config))


def read_adapter_header(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """A PEFT folder's adapter_config.json and its tensors' shapes (from the safetensors header, no data read).

    Raises:
        UserError: a missing or unreadable file, naming it.
    """
    folder = Path(adapter_dir)
    config_path, weights_path = folder / ADAPTER_CONFIG_FILE, folder / ADAPTER_WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise UserError(f"adapter.checkpoint_dir={adapter_dir}: {path.name} is missing (a PEFT adapter folder, "
                            "as PeftModel.save_pretrained writes it, holds adapter_config.json and "
                            "adapter_model.safetensors)")
    config = read_json(config_path)
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - any unreadable header is the user's file
        raise UserError(f"adapter.checkpoint_dir={adapter_dir}: {weights_path.name} cannot be read: {err}") from err
    return config, shapes


def read_adapter_tensors(adapter_dir: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT folder's tensors, whole, on the CPU (adapters are small)."""
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS_FILE), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}
