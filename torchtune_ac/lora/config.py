"""The ``adapter:`` section: which linears get low-rank adapters, of what kind and rank, and how the base is stored.

Names are PEFT's (``target_modules``, ``r`` as ``rank``, ``lora_alpha`` as ``alpha``, ``lora_dropout`` as ``dropout``,
``use_dora`` as ``kind: dora``), so a PEFT user's settings carry over and the adapters a run saves are PEFT's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UserError

__all__ = ["AdapterConfig", "AdapterKind", "QuantizeBase", "DEFAULT_TARGETS", "adapter_record"]


class AdapterKind(str, enum.Enum):
    LORA = "lora"
    DORA = "dora"


class QuantizeBase(str, enum.Enum):
    NF4 = "nf4"


# PEFT's own default for Llama-style models (peft.utils.constants' TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
# names q_proj and v_proj for llama, mistral, qwen2, gemma, ...); torchtune's lora_attn_modules default is the same.
DEFAULT_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """Low-rank adapters (LoRA, DoRA) on the chosen linears of a frozen base; QLoRA with ``quantize_base: nf4``."""

    kind: AdapterKind = config_key(
        AdapterKind.LORA, doc="lora: W x + (alpha / rank) B A x (PEFT's LoRA); dora: the same update, each output row "
        "of W + (alpha / rank) B A rescaled to a trained magnitude (PEFT's use_dora).")
    rank: int = config_key(8, doc="The adapters' rank r (PEFT's r): A is [r, in], B is [out, r].", minimum=1)
    alpha: float = config_key(
        16.0, doc="The update's scale is alpha / rank (PEFT's lora_alpha).", exclusive_minimum=0.0)
    dropout: float = config_key(
        0.0, doc="Dropout on the adapters' input in training (PEFT's lora_dropout); the base's path has none.",
        minimum=0.0, exclusive_maximum=1.0)
    targets: list[str] = config_key(
        doc="The linears that get adapters, by PEFT's target_modules names (the last part of the module's name in "
        "Hugging Face's layout): q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. A name that matches "
        "no linear of the model is refused with the names that exist. Experts of a mixture of experts are not "
        "targets; their attention and dense layers are. On a vision-language model the names resolve on the "
        "language model only: the vision tower's and projector's linears are not targets.",
        default_factory=lambda: list(DEFAULT_TARGETS))
    output: bool = config_key(
        False, doc="Also an adapter on the output projection (lm_head); not with tied embeddings.")
    quantize_base: Optional[QuantizeBase] = config_key(
        None, doc="nf4: QLoRA, the frozen base weight of every adapted linear stored as torchao's NF4Tensor (4 bits "
        "a weight, blocks of 64 with a scale quantised in blocks of 256), dequantised for each matmul; sharded by FSDP2 "
        "over several processes when each linear splits by rows into whole blocks (not with CPU offload nor HSDP). "
        "null: the base in dtype.")
    checkpoint_dir: Optional[str] = config_key(
        None, doc="A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from; it must be "
        "for this base (the same module names and shapes) and this kind and rank. null: A drawn Kaiming-uniform and "
        "B zero, as PEFT does, so step 0 is the base exactly.", non_empty=True)
    save_merged: bool = config_key(
        False, doc="Each checkpoint also holds the merged model (base + adapters) in Hugging Face's layout, with the "
        "tokenizer's files, in its subfolder merged/, which AutoModelForCausalLM.from_pretrained and tune generate "
        "load alone; the adapters are always saved, in PEFT's format, in the checkpoint folder itself.")

    def __post_init__(self) -> None:
        if not self.targets and not self.output:
            raise UserError("adapter.targets=[]: name at least one linear (q_proj, v_proj, ...) or set "
                            "adapter.output: true")
        duplicates = sorted({t for t in self.targets if self.targets.count(t) > 1})
        if duplicates:
            raise UserError(f"adapter.targets: {', '.join(duplicates)} named twice")

    @property
    def scale(self) -> float:
        """The update's scale, ``alpha / rank`` (PEFT's ``scaling`` without rsLoRA)."""
        return self.alpha / self.rank

    def describe(self) -> str:
        """One line for ``tune validate`` and the run's log."""
        what = f"{self.kind.value} rank {self.rank}, alpha {self.alpha:g}"
        if self.dropout:
            what += f", dropout {self.dropout:g}"
        where = ", ".join(self.targets + (["output"] if self.output else []))
        base = "NF4 (QLoRA)" if self.quantize_base is QuantizeBase.NF4 else "in dtype"
        start = f"from {self.checkpoint_dir}" if self.checkpoint_dir else "A Kaiming-uniform, B zero"
        return f"{what} on {where}; base frozen, {base}; {start}"


def adapter_record(config: AdapterConfig) -> dict:
    """What a resume must keep of the adapters (their shapes and what they compute), recorded in every checkpoint."""
    return {"kind": config.kind.value, "rank": config.rank, "alpha": config.alpha, "targets": list(config.targets),
            "output": config.output,
            "quantize_base": None if config.quantize_base is None else config.quantize_base.value}
