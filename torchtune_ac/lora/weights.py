"""The adapters' checks before any weight is loaded (``check_adapter_start``), and their starting values once the
base weights are in place (``load_or_initialize_adapters_``): QLoRA's base stored in NF4, then PEFT's
initialisation, or a PEFT adapter folder's (``adapter.checkpoint_dir``)."""

from __future__ import annotations

import copy

from torch import nn

from torchtune_ac.checkpoint.peft import read_adapter_header, read_adapter_tensors
from torchtune_ac.lora.config import AdapterConfig, QuantizeBase
from torchtune_ac.lora.mechanism import apply_adapters, copy_whole_, initialize_adapters_, quantize_base_
from torchtune_ac.lora.peft_names import adapter_tensor, check_adapter_folder, check_peft_names, peft_keys


def check_adapter_start(model: nn.Module, config: AdapterConfig, *, loss_chunks: int) -> None:
    """Everything about the ``adapter:`` section that can be refused before any weight is loaded, on the meta
    ``model`` (left unchanged): the targets and what NF4 can quantise (``check_adapters``), their PEFT names, and a
    PEFT folder to start from against this base (its config and tensor headers read, no data).

    Raises:
        UserError: one line, naming the key.
    """
    adapted = copy.deepcopy(model)
    targets = apply_adapters(adapted, config, loss_chunks=loss_chunks)
    check_peft_names(adapted, targets)
    if config.checkpoint_dir is not None:
        peft, shapes = read_adapter_header(config.checkpoint_dir)
        check_adapter_folder(adapted, config, config.checkpoint_dir, peft, shapes)


def load_or_initialize_adapters_(model: nn.Module, config: AdapterConfig, *, seed: int) -> None:
    """Fill ``model``'s adapters (see the module docstring); the base must be loaded already (DoRA's magnitude and
    the NF4 weights are computed from it)."""
    if config.quantize_base is QuantizeBase.NF4:  # first: DoRA's magnitude is the norms of the NF4 base's rows
        quantize_base_(model)
    initialize_adapters_(model, seed=seed)
    if config.checkpoint_dir is not None:
        tensors = read_adapter_tensors(config.checkpoint_dir)
        for key, (linear, part, _) in peft_keys(model).items():
            copy_whole_(adapter_tensor(linear, part).data, tensors[key])
