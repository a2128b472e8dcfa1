"""Typed schemas of the recipes' configs: every key, its type, its default, in one place.

Top-level names follow torchtune's where torchtune has one, so a torchtune user's configs and command lines
carry over. Nothing downstream reads raw config keys: recipes receive these dataclasses, and pass the grouped
settings on whole (``cfg.ac``, ``cfg.memory``, ``cfg.fsdp``).

Groups of settings belong to the subsystem that uses them (``ACConfig`` to activation checkpointing,
``FSDPConfig`` to sharding, extended with the memory switches' ``fsdp.*`` keys); this module composes them. A group marked ``flatten`` keeps its keys at the top
level of the YAML (``ac_mode: full``, not ``ac: {mode: full}``), as torchtune names them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from torchtune_ac.config.components import Component
from torchtune_ac.memory.activation_checkpointing import ACConfig
from torchtune_ac.memory.plan import FSDPConfig, MemoryConfig
from torchtune_ac.runtime.distributed import DEFAULT_TIMEOUT_S
from torchtune_ac.runtime.dtypes import DType

__all__ = ["Device", "DType", "FSDPConfig", "FullFinetuneConfig"]


class Device(str, enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


def _min(value: int) -> dict:
    return {"minimum": value}


# A key torchtune has too, with the same name and meaning: tune migrate copies it unchanged.
SAME = {"torchtune": "same"}


@dataclass(frozen=True)
class FullFinetuneConfig:
    """Config of the ``full_finetune`` recipe."""

    # An empty path would mean the current directory.
    output_dir: str = field(metadata={"non_empty": True})
    model: Component = field(metadata={})
    tokenizer: Component = field(metadata={})
    dataset: Component = field(metadata={"positional": 1, "recipe_kwargs": ("max_seq_len",)})
    optimizer: Component = field(metadata={"positional": 1})
    # Hugging Face checkpoint directory to start from (config.json + safetensors); null = random init.
    checkpoint_dir: Optional[str] = field(default=None, metadata={"non_empty": True})
    resume_from_checkpoint: bool = field(default=False, metadata=SAME)
    lr_scheduler: Optional[Component] = field(default=None, metadata={"positional": 1, "recipe_kwargs": ("num_training_steps",)})
    # Held-out data for the validation loss (a dataset component like ``dataset``); null: no validation.
    dataset_val: Optional[Component] = field(default=None, metadata={"positional": 1, "recipe_kwargs": ("max_seq_len",)})
    # Validate every N optimizer steps; null: at the end of every epoch (when dataset_val is set).
    run_val_every_n_steps: Optional[int] = field(default=None, metadata={**_min(1), **SAME})
    # Samples per process per validation batch; null: batch_size.
    batch_size_val: Optional[int] = field(default=None, metadata={**_min(1), **SAME})
    batch_size: int = field(default=1, metadata={**_min(1), **SAME})
    epochs: int = field(default=1, metadata={**_min(1), **SAME})
    max_steps_per_epoch: Optional[int] = field(default=None, metadata={**_min(1), **SAME})
    gradient_accumulation_steps: int = field(default=1, metadata={**_min(1), **SAME})
    max_seq_len: Optional[int] = field(default=None, metadata=_min(1))
    clip_grad_norm: Optional[float] = field(default=None, metadata={"exclusive_minimum": 0.0, **SAME})
    # torch.manual_seed takes at most 64 bits, and epoch e seeds the data order with seed + e.
    seed: int = field(default=0, metadata={"minimum": 0, "maximum": 2**63 - 1})
    shuffle: bool = field(default=True, metadata=SAME)
    device: Device = Device.AUTO
    dtype: DType = DType.FP32
    compile: bool = field(default=False, metadata=SAME)
    # On CUDA, float32 matrix multiplies and convolutions run in TF32 (10-bit mantissa inputs, float32 sums).
    allow_tf32: bool = True
    # How long a rank waits in one collective before the run fails: the others wait while rank 0 alone writes,
    # fsyncs and prunes a checkpoint (NCCL's own default is 10 minutes).
    distributed_timeout_s: int = field(default=DEFAULT_TIMEOUT_S, metadata=_min(1))
    # enable_activation_checkpointing, ac_mode, ac_option (top-level keys); the bound of ac_option (at most the
    # model's layer count) is checked once the model is built.
    ac: ACConfig = field(default_factory=ACConfig, metadata={"flatten": True})
    # The memory switches' top-level keys (optimizer_in_bwd, loss_chunks, ...); see memory/plan.py.
    memory: MemoryConfig = field(default_factory=MemoryConfig, metadata={"flatten": True})
    save_every_n_steps: Optional[int] = field(default=None, metadata={**_min(1), **SAME})
    # Keep the newest N checkpoints whole, delete older ones once a new one is verified; null: keep every
    # checkpoint's model files, and recipe state in the newest two (see checkpoint/recipe_state.py).
    keep_last_n_checkpoints: Optional[int] = field(default=None, metadata=_min(1))
    log_every_n_steps: int = field(default=1, metadata={**_min(1), **SAME})
    # Experiment tracker besides metrics.jsonl (always written): torchtune_ac.training.metric_logging.*, or null.
    metric_logger: Optional[Component] = None
    # FSDP2's settings and the memory switches' fsdp.* keys; a field's metadata names torchtune's key for it.
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
