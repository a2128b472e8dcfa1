"""Models: the Llama decoder, the model families built on it (their builders and pure Hugging Face adapters),
and the family interface generic code goes through.

``load_hf``, ``save_hf``, ``load_hf_weights_``, ``from_hf_config`` and ``llama_from_hf_config`` read or write
files, so they live in ``torchtune_ac.checkpoint``; they are named here too (scripts and configs use these
names) and imported on first use, so that this package depends on nothing above it.
"""

from typing import Any

from torchtune_ac.models.families import FAMILIES, family_for_hf_config, family_of, transformer_blocks
from torchtune_ac.models.families.llama import (
    LLAMA,
    llama2_7b,
    llama3_1_8b,
    llama3_1_70b,
    llama3_2_1b,
    llama3_2_3b,
    llama3_8b,
    llama3_70b,
    llama_small,
    llama_small_32k,
    llama_tiny,
)
from torchtune_ac.models.families.mistral import MISTRAL, Mistral, mistral_7b
from torchtune_ac.models.families.qwen2 import QWEN2, Qwen2, qwen2_5_0_5b, qwen2_5_1_5b, qwen2_5_7b
from torchtune_ac.models.family import HFAdapter, ModelFamily
from torchtune_ac.models.llama import Llama, LlamaArgs, RopeScaling

_FROM_CHECKPOINT_PACKAGE = ("from_hf_config", "llama_from_hf_config", "load_hf", "load_hf_weights_", "save_hf")

__all__ = [
    "FAMILIES",
    "HFAdapter",
    "LLAMA",
    "Llama",
    "LlamaArgs",
    "MISTRAL",
    "Mistral",
    "ModelFamily",
    "QWEN2",
    "Qwen2",
    "RopeScaling",
    "family_for_hf_config",
    "family_of",
    "llama2_7b",
    "llama3_1_8b",
    "llama3_1_70b",
    "llama3_2_1b",
    "llama3_2_3b",
    "llama3_8b",
    "llama3_70b",
    "llama_small",
    "llama_small_32k",
    "llama_tiny",
    "mistral_7b",
    "qwen2_5_0_5b",
    "qwen2_5_1_5b",
    "qwen2_5_7b",
    "transformer_blocks",
    *_FROM_CHECKPOINT_PACKAGE,
]


def __getattr__(name: str) -> Any:
    if name in _FROM_CHECKPOINT_PACKAGE:
        from torchtune_ac.checkpoint import hf

        return getattr(hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_CHECKPOINT_PACKAGE))
