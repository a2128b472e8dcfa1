"""The adapters' starting values, once the base weights are in place: PEFT's initialisation, or a PEFT adapter
folder's (``adapter.checkpoint_dir``); then QLoRA's base stored in NF4."""

from __future__ import annotations

from torch import nn

from torchtune_ac.lora.config import AdapterConfig, QuantizeBase
from torchtune_ac.lora.mechanism import initialize_adapters_, quantize_base_


def load_or_initialize_adapters_(model: nn.Module, config: AdapterConfig, *, seed: int) -> None:
    """Fill ``model``'s adapters (see the module docstring); the base must be loaded already (DoRA's magnitude and
    the NF4 weights are computed from it)."""
    initialize_adapters_(model, seed=seed)
    if config.quantize_base is QuantizeBase.NF4:
        quantize_base_(model)
