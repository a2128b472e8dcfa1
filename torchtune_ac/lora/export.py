"""What a checkpoint of a run with adapters holds: the adapters as a PEFT folder, and with ``save_merged`` the
merged model in Hugging Face's layout, in the checkpoint's subfolder ``merged/`` (``checkpoint/``'s writers write
both)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from torch import nn

from torchtune_ac.checkpoint import HFModelFiles
from torchtune_ac.checkpoint.peft import AdapterFiles
from torchtune_ac.lora.config import AdapterConfig
from torchtune_ac.lora.mechanism import adapted_linears, base_only, merged_weight
from torchtune_ac.lora.peft_names import peft_config, peft_excluded_modules, peft_tensors
from torchtune_ac.models import hf_model_files
from torchtune_ac.models.families import require_family


def adapter_files(model: nn.Module, config: AdapterConfig, *, base_model: Optional[str]) -> AdapterFiles:
    """The adapters by PEFT's names and adapter_config.json (``base_model``: the base's folder, for its
    ``base_model_name_or_path``)."""
    return AdapterFiles(peft_tensors(model), peft_config(config, base_model=base_model,
                                                         exclude_modules=peft_excluded_modules(model)))


def merged_model_files(model: nn.Module, *, base_config: Optional[Mapping[str, Any]] = None,
                       **token_ids: Any) -> HFModelFiles:
    """The merged model's Hugging Face files: the base's tensors, each adapted linear's weight merged
    (``merged_weight``: a sharded model's stay sharded, gathered by the writer one shard at a time)."""
    family = require_family(model, "the merged model")
    with base_only(model):
        files = hf_model_files(model, base_config=base_config, **token_ids)
    tensors = dict(files.tensors)
    for name, linear in adapted_linears(model):
        tensors[family.hf.to_hf_name(f"{name}.weight")] = merged_weight(linear)
    return dataclasses.replace(files, tensors=tensors)
