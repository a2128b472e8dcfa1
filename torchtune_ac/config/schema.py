"""Typed schemas of the recipes' configs: every key, its type, its default, in one place.

Top-level names follow torchtune's where torchtune has one, so a torchtune user's configs and command lines
carry over. Nothing downstream reads raw config keys: recipes receive these dataclasses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from torchtune_ac.config.components import Component


class Device(str, enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class DType(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


def _min(value: int) -> dict:
    return {"minimum": value}


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 settings, used when the run has more than one process."""

    # Free each block's gathered parameters after its forward (saves memory, re-gathers in backward).
    reshard_after_forward: bool = True
    # Mixed precision: dtype of the gathered parameters used in forward/backward (null: same as `dtype`).
    param_dtype: Optional[DType] = None
    # dtype of the gradient reduce-scatter (fp32 keeps reductions exact when param_dtype is bf16).
    reduce_dtype: DType = DType.FP32


@dataclass(frozen=True)
class FullFinetuneConfig:
    """Config of the ``full_finetune`` recipe."""

    output_dir: str
    model: Component = field(metadata={})
    tokenizer: Component = field(metadata={})
    dataset: Component = field(metadata={"positional": 1, "recipe_kwargs": ("max_seq_len",)})
    optimizer: Component = field(metadata={"positional": 1})
    # Hugging Face checkpoint directory to start from (config.json + safetensors); null = random init.
    checkpoint_dir: Optional[str] = None
    resume_from_checkpoint: bool = False
    lr_scheduler: Optional[Component] = field(default=None, metadata={"positional": 1, "recipe_kwargs": ("num_training_steps",)})
    batch_size: int = field(default=1, metadata=_min(1))
    epochs: int = field(default=1, metadata=_min(1))
    max_steps_per_epoch: Optional[int] = field(default=None, metadata=_min(1))
    gradient_accumulation_steps: int = field(default=1, metadata=_min(1))
    max_seq_len: Optional[int] = field(default=None, metadata=_min(1))
    clip_grad_norm: Optional[float] = field(default=None, metadata={"exclusive_minimum": 0.0})
    seed: int = 0
    shuffle: bool = True
    device: Device = Device.AUTO
    dtype: DType = DType.FP32
    compile: bool = False
    enable_activation_checkpointing: Optional[bool] = None
    # Validated (with the model's layer count) by torchtune_ac.training.activation_checkpointing.
    ac_mode: Optional[str] = None
    ac_option: Any = None
    save_every_n_steps: Optional[int] = field(default=None, metadata=_min(1))
    log_every_n_steps: int = field(default=1, metadata=_min(1))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
