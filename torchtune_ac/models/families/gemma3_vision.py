"""The Gemma 3 vision-language family: Gemma 3's decoder (``models/families/gemma3.py``), a SigLIP tower and the
projector whose image features replace the image tokens' embeddings (``models/vision/gemma3.py``).

Checkpoints: a multimodal Gemma 3 checkpoint (``model_type: gemma3``) is found by the text family
(``from_hf_config`` and ``load_hf`` build its text tower, as before); a model of this family, chosen by its builder
(``gemma3_4b_vision``, ...), loads the same files whole. Google's files keep the parts under
``language_model.model.``, ``vision_tower.vision_model.`` and ``multi_modal_projector.``; transformers 5 writes
``vision_tower.`` without ``vision_model.``, and holds them under ``model.``: every form loads, and a model is
saved in transformers 5's in-memory layout (``model.language_model.``, ``model.vision_tower.``,
``model.multi_modal_projector.``), ``config.json`` nested (``text_config``, ``vision_config``), which transformers
reads back as ``Gemma3ForConditionalGeneration``. The vision tower's unused pooling head
(``vision_use_head: true``) is not loaded.

Activation checkpointing and FSDP2 see the tower's blocks, then the decoder's (the order forward runs them):
``ac_option: k`` checkpoints every k-th of them all, counting the tower's first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

from torchtune_ac.errors import UserError
from torchtune_ac.models.families import gemma3
from torchtune_ac.models.families.gemma3 import Gemma3HFAdapter
from torchtune_ac.models.family import ImageInputs
from torchtune_ac.models.hf_adapter import read_value
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.models.vision.gemma3 import (Gemma3Vision, Gemma3VisionArgs, SiglipArgs, planned_image_inputs,
                                              resized_image)
from torchtune_ac.models.vision_family import VisionParts, vision_family

_TEXT_HF: Gemma3HFAdapter = gemma3.FAMILY.hf
SIGLIP_400M = SiglipArgs()  # Gemma 3's tower: 27 blocks of 1152, 896-pixel images in 14-pixel patches


def _vision(text: LlamaArgs, vision: SiglipArgs = SIGLIP_400M) -> Gemma3VisionArgs:
    fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(LlamaArgs)}
    return Gemma3VisionArgs(**{**fields, "model_type": "gemma3"}, vision=vision)


GEMMA3_4B_VISION = _vision(gemma3.GEMMA3_4B)
GEMMA3_12B_VISION = _vision(gemma3.GEMMA3_12B)
GEMMA3_27B_VISION = _vision(gemma3.GEMMA3_27B)
# For CI: a decoder of 2 layers (a sliding one of 6 tokens, then a global one) over the embedded tokenizer's 512
# tokens and Gemma 3's 5 turn and image tokens (``<image_soft_token>`` 516), and a tower of 2 blocks taking 56-pixel
# images in 14-pixel patches, pooled to 2 x 2 = 4 tokens per image.
GEMMA3_VISION_TINY = Gemma3VisionArgs(
    vocab_size=517, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=128, max_seq_len=2048,
    norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=True, head_dim=16, model_type="gemma3", qk_norm=True,
    norm_offset=1.0, scale_embeddings=True, activation="gelu_pytorch_tanh", query_pre_attn_scalar=16,
    sliding_window=6, layer_types=("sliding_attention", "full_attention"), sliding_rope_theta=10_000.0,
    vision=SiglipArgs(depth=2, dim=32, intermediate_dim=64, n_heads=2, image_size=56, patch_size=14),
    mm_tokens_per_image=4, image_token_id=516)

# A stored tensor's prefix -> ours in transformers 5's layout (longest first: no prefix hides a longer one).
_PREFIXES = (
    ("model.vision_tower.vision_model.", "model.vision_tower."), ("vision_tower.vision_model.", "model.vision_tower."),
    ("model.vision_tower.", "model.vision_tower."), ("vision_tower.", "model.vision_tower."),
    ("model.multi_modal_projector.", "model.multi_modal_projector."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
    ("model.language_model.", "model.language_model."), ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
)
# config.json ``vision_config`` key -> (``SiglipArgs`` field, kind, transformers' ``SiglipVisionConfig`` default).
_VISION_KEYS = {
    "num_hidden_layers": ("depth", int, 12), "hidden_size": ("dim", int, 768),
    "intermediate_size": ("intermediate_dim", int, 3072), "num_attention_heads": ("n_heads", int, 12),
    "image_size": ("image_size", int, 224), "patch_size": ("patch_size", int, 16),
    "num_channels": ("in_channels", int, 3), "layer_norm_eps": ("norm_eps", float, 1e-6),
    "hidden_act": ("activation", str, "gelu_pytorch_tanh"),
}
# Gemma3Config's defaults for the multimodal keys (``image_token_id`` and the others are also spelled so).
_TOKEN_KEYS = {"image_token_index": 262_144, "boi_token_index": 255_999, "eoi_token_index": 256_000}


def _vision_config(vision: SiglipArgs) -> dict[str, Any]:
    return {key: getattr(vision, field) for key, (field, _, _) in _VISION_KEYS.items()}


def _text_args(args: Gemma3VisionArgs) -> LlamaArgs:
    return LlamaArgs(**{**{f.name: getattr(args, f.name) for f in dataclasses.fields(LlamaArgs)},
                        "model_type": _TEXT_HF.model_type})


class Gemma3VisionHFAdapter(Gemma3HFAdapter):
    """Gemma 3's multimodal config.json and tensor names: the text family's for the decoder (under
    ``text_config`` and ``model.language_model.``), the tower's and the projector's beside them."""

    @property
    def model_types_read(self) -> tuple[str, ...]:
        return ()  # a gemma3 config.json is the text family's to build (module docstring)

    @property
    def model_types_loaded(self) -> tuple[str, ...]:
        return ("gemma3",)

    def check_args(self, args: LlamaArgs) -> None:
        if not isinstance(args, Gemma3VisionArgs):
            raise ValueError(f"{type(args).__name__}: Gemma 3 with images needs Gemma3VisionArgs (a vision tower)")
        super().check_args(args)

    def to_hf_name(self, name: str) -> str:
        if name.startswith(("vision_tower.", "multi_modal_projector.")):
            return "model." + name
        hf = super().to_hf_name(name)
        return hf.replace("model.", "model.language_model.", 1) if hf.startswith("model.") else hf

    def stored_name(self, config: Mapping[str, Any], name: str) -> Optional[str]:
        if name.endswith(".rotary_emb.inv_freq"):
            return None
        for prefix, ours in _PREFIXES:
            if name.startswith(prefix):
                stored = ours + name[len(prefix):]
                return None if stored.startswith("model.vision_tower.head.") else stored  # the unused head
        return None

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Gemma3VisionArgs:
        problems: list[str] = []
        if config.get("model_type") != "gemma3":
            problems.append(f"model_type={config.get('model_type')!r}: Gemma 3 with images reads 'gemma3' "
                            "checkpoints (Gemma3ForConditionalGeneration)")
        vision_config = config.get("vision_config")
        if not isinstance(vision_config, Mapping):
            problems.append("vision_config: missing (not a vision-language checkpoint)")
            vision_config = {}
        if vision_config.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            problems.append(f"vision_config.model_type={vision_config['model_type']!r}: only a SigLIP tower "
                            "(siglip_vision_model) is supported")
        vision = {field: read_value(vision_config, key, kind, problems, default=default, prefix="vision_config.")
                  for key, (field, kind, default) in _VISION_KEYS.items()}
        tokens = read_value(config, "mm_tokens_per_image", int, problems, default=256)
        image_token = read_value(config, "image_token_index", int, problems,
                                 default=config.get("image_token_id", _TOKEN_KEYS["image_token_index"]))
        text = None
        try:
            text = _TEXT_HF.args_from_hf_config({**config, "model_type": "gemma3"}, **overrides)
        except UserError as e:
            problems.append(str(e).removeprefix(f"unsupported Hugging Face {_TEXT_HF.model_type} config: "))
        if problems:
            raise UserError("unsupported Hugging Face gemma3 (vision) config: " + "; ".join(problems))
        try:
            fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(LlamaArgs)}
            return Gemma3VisionArgs(**{**fields, "model_type": "gemma3"}, vision=SiglipArgs(**vision),
                                    mm_tokens_per_image=tokens, image_token_id=image_token)
        except ValueError as e:
            raise UserError(f"Hugging Face gemma3 (vision) config: {e}") from None

    def hf_config_from_args(self, args: Gemma3VisionArgs, dtype: torch.dtype, *,
                            base_config: Optional[Mapping[str, Any]] = None, **token_ids: Any) -> dict[str, Any]:
        base = dict(base_config or {})
        text = _TEXT_HF.hf_config_from_args(_text_args(args), dtype, base_config=base or None, **token_ids)
        text.pop("architectures")
        vision = {**(base.get("vision_config") or {}), **_vision_config(args.vision),
                  "model_type": "siglip_vision_model", "vision_use_head": False}
        top = {k: v for k, v in base.items() if k not in ("text_config", "vision_config", "torch_dtype")}
        top.update({key: base.get(key, default) for key, default in _TOKEN_KEYS.items()})
        top.pop("image_token_id", None)
        top.update(architectures=[self.architecture_name], model_type=self.model_type, text_config=text,
                   vision_config=vision, mm_tokens_per_image=args.mm_tokens_per_image,
                   image_token_index=args.image_token_id, tie_word_embeddings=args.tie_embeddings, dtype=text["dtype"])
        return top

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        vision = {f"vision_config.{k}": v for k, v in _vision_config(args.vision).items()}
        return {**super().family_architecture(args), "mm_tokens_per_image": args.mm_tokens_per_image,
                "image_token_index": args.image_token_id, **vision}


HF = Gemma3VisionHFAdapter(**{**{f.name: getattr(_TEXT_HF, f.name) for f in dataclasses.fields(_TEXT_HF)},
                              "model_type": "gemma3", "architecture_name": "Gemma3ForConditionalGeneration"})


PARTS = VisionParts(tower=("vision_tower",), projector=("multi_modal_projector",),
                    tower_blocks="vision_tower.encoder.layers",
                    shard_groups=(("vision_tower.embeddings",),
                                  ("vision_tower.post_layernorm", "multi_modal_projector")))
FAMILY = vision_family(
    __name__, "gemma3_vision", Gemma3Vision, HF,
    {
        "gemma3_4b_vision": (GEMMA3_4B_VISION, "Gemma 3 4B with images (4,300,079,472 parameters, tied embeddings)."),
        "gemma3_12b_vision": (GEMMA3_12B_VISION,
                              "Gemma 3 12B with images (12,187,325,040 parameters, tied embeddings)."),
        "gemma3_27b_vision": (GEMMA3_27B_VISION,
                              "Gemma 3 27B with images (27,432,406,640 parameters, tied embeddings)."),
        "gemma3_vision_tiny": (GEMMA3_VISION_TINY, "A tiny Gemma 3 with images, for CI (tied embeddings)."),
    },
    PARTS,
    freeze_doc=(" ``freeze_vision_tower``: the SigLIP tower is not trained; ``freeze_projector``: nor "
                "is the projector."),
    vision_modules=("vision_tower", "multi_modal_projector"),
    images=ImageInputs(resized=resized_image, batch=planned_image_inputs, default_max_pixels=None),
)
build, freeze_ = FAMILY.build, PARTS.freeze_
# The builders are names of this module too (``torchtune_ac.models.families.gemma3_vision.gemma3_4b_vision``).
globals().update(FAMILY.builders)
