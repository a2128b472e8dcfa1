"""Typed schemas of the recipes' configs: every key, its type, its default, in one place.

Top-level names follow torchtune's where torchtune has one, so a torchtune user's configs and command lines
carry over. Nothing downstream reads raw config keys: recipes receive these dataclasses.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from torchtune_ac.config.components import Component
from torchtune_ac.training.activation_checkpointing import ac_key_problems


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
    # Their forms are checked by cross_key_problems below (the AC module's rules, one message per problem),
    # their bound against the model's layer count when the model is built.
    ac_mode: Any = None
    ac_option: Any = None
    save_every_n_steps: Optional[int] = field(default=None, metadata=_min(1))
    log_every_n_steps: int = field(default=1, metadata=_min(1))
    # Experiment tracker besides metrics.jsonl (always written): torchtune_ac.training.metric_logging.*, or null.
    metric_logger: Optional[Component] = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    @staticmethod
    def cross_key_problems(values: Mapping[str, Any]) -> list[str]:
        """Problems that span keys, reported with the per-key ones: the activation checkpointing keys.

        Their bound on ``ac_option`` (at most the model's layer count) is checked once the model is built.
        """
        enable = values.get("enable_activation_checkpointing")
        return ac_key_problems(
            # A non-boolean is already reported by its type check.
            enable_activation_checkpointing=enable if isinstance(enable, bool) else None,
            ac_mode=values.get("ac_mode"),
            ac_option=values.get("ac_option"),
        )
