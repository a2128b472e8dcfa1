"""The Qwen2.5-VL family: Qwen2's decoder with multimodal RoPE, and a vision tower whose merged patches replace the
image tokens' embeddings (``models/vision/qwen2_5_vl.py``).

Checkpoints: the published files keep the decoder under ``model.`` and the tower under ``visual.`` (transformers
4's layout); transformers 5 saves them under ``model.language_model.`` and ``model.visual.``: both load, a model is
saved in transformers 5's layout (which transformers 4.52 and later read too). The published config.json is flat
(the decoder's keys at the top, ``rope_scaling: {type: mrope, mrope_section}``); transformers 5's nests them in
``text_config``: both are read, the nested form is written.

Activation checkpointing and FSDP2 see the tower's blocks, then the decoder's (the order forward runs them):
``ac_option: k`` checkpoints every k-th of them all, counting the tower's first.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, Optional

import torch

from torchtune_ac.errors import UserError
from torchtune_ac.models.family import ImageInputs
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, Refusal, read_value, refuse_truthy
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.models.vision.qwen2_5_vl import (Qwen2_5_VL, Qwen2_5_VLArgs, VisionArgs, planned_image_inputs,
                                                   resized_image)
from torchtune_ac.models.vision_family import VisionParts, vision_family

_VISION_7B = VisionArgs(depth=32, dim=1280, intermediate_dim=3420, n_heads=16, out_dim=3584)
QWEN2_5_VL_3B = Qwen2_5_VLArgs(
    vocab_size=151_936, dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, intermediate_dim=11_008, max_seq_len=128_000,
    norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=True, model_type="qwen2_5_vl", qkv_bias=True,
    vision=dataclasses.replace(_VISION_7B, out_dim=2048))
QWEN2_5_VL_7B = Qwen2_5_VLArgs(
    vocab_size=152_064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_dim=18_944, max_seq_len=128_000,
    norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=False, model_type="qwen2_5_vl", qkv_bias=True,
    vision=_VISION_7B)
# For CI: the embedded processor's vocabulary (518 tokens, ``<|image_pad|>`` 516) and patch sizes (14-pixel patches
# of 2 frames, merged 2 x 2); windows of 56 pixels (2 x 2 merge units), a windowed tower block then a full one.
QWEN2_5_VL_TINY = Qwen2_5_VLArgs(
    vocab_size=518, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=128, max_seq_len=2048,
    norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=True, model_type="qwen2_5_vl", qkv_bias=True,
    vision=VisionArgs(depth=2, dim=32, intermediate_dim=64, n_heads=2, out_dim=64, window_size=56,
                      fullatt_block_indexes=(1,)),
    image_token_id=516, mrope_section=(4, 2, 2))

# Our tower's names are transformers' under ``visual.``; the decoder's under ``model.language_model.`` in
# transformers 5's layout. A published (transformers 4) checkpoint's prefixes -> those.
_LEGACY_PREFIXES = (("visual.", "model.visual."), ("model.visual.", "model.visual."),
                    ("model.language_model.", "model.language_model."), ("model.", "model.language_model."),
                    ("lm_head.", "lm_head."))
# config.json ``vision_config`` key -> (``VisionArgs`` field, kind); ``in_chans``: the published files' spelling.
_VISION_KEYS = {
    "depth": ("depth", int), "hidden_size": ("dim", int), "intermediate_size": ("intermediate_dim", int),
    "num_heads": ("n_heads", int), "out_hidden_size": ("out_dim", int), "in_channels": ("in_channels", int),
    "patch_size": ("patch_size", int), "temporal_patch_size": ("temporal_patch_size", int),
    "spatial_merge_size": ("spatial_merge_size", int), "window_size": ("window_size", int),
    "hidden_act": ("activation", str),
}
# transformers' Qwen2-VL image processor's max_pixels when its preprocessor_config.json gives none: 1280 tokens.
PROCESSOR_MAX_PIXELS = 28 * 28 * 1280
_TOP_LEVEL_TOKENS = {"video_token_id": 151_656, "vision_start_token_id": 151_652, "vision_end_token_id": 151_653}


_MROPE_KEYS = ("type", "rope_type", "mrope_section", "mrope_interleaved")


def _text_config(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The decoder's keys of a config.json, flat or nested (``text_config``), with its RoPE as the default type."""
    text = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    text.update(config.get("text_config") or {})
    text["model_type"] = model_type
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) in ("mrope", "default"):
            text[key] = {k: v for k, v in rope.items() if k not in _MROPE_KEYS} or None
    if "tie_word_embeddings" in config:  # the top-level value is the model's (transformers 5 nests a copy)
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def _mrope_section(config: Mapping[str, Any]) -> Any:
    for source in (config.get("text_config") or {}, config):
        for key in ("rope_parameters", "rope_scaling"):
            rope = source.get(key)
            if isinstance(rope, Mapping) and "mrope_section" in rope:
                return rope["mrope_section"]
    return None


class Qwen2_5_VLHFAdapter(LlamaStyleHFAdapter):
    """Qwen2.5-VL's config.json (flat or nested) and tensor names (both layouts). Qwen3-VL's adapter is this one
    over its own tables (the class attributes below)."""

    display_name: ClassVar[str] = "Qwen2.5-VL"
    args_class: ClassVar[type] = Qwen2_5_VLArgs
    vision_class: ClassVar[type] = VisionArgs
    vision_keys: ClassVar[Mapping[str, tuple[str, type]]] = _VISION_KEYS
    # config.json ``vision_config`` key -> its other spelling, read when the key is absent and never written.
    vision_key_spellings: ClassVar[Mapping[str, str]] = {"in_channels": "in_chans"}
    block_indexes_key: ClassVar[str] = "fullatt_block_indexes"  # the tower's list of block indexes
    text_rope_extra: ClassVar[Mapping[str, Any]] = {}  # written into the decoder's ``rope_parameters``

    def check_args(self, args: LlamaArgs) -> None:
        if not isinstance(args, self.args_class):
            raise ValueError(f"{type(args).__name__}: {self.display_name} needs {self.args_class.__name__} "
                             "(a vision tower)")
        super().check_args(args)

    def to_hf_name(self, name: str) -> str:
        if name.startswith("visual."):
            return "model." + name
        hf = super().to_hf_name(name)
        return hf.replace("model.", "model.language_model.", 1) if hf.startswith("model.") else hf

    def stored_name(self, config: Mapping[str, Any], name: str) -> Optional[str]:
        if super().stored_name(config, name) is None:
            return None
        for prefix, ours in _LEGACY_PREFIXES:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return None

    def _vision_architecture(self, vision: Any) -> dict[str, Any]:
        values = {key: getattr(vision, field) for key, (field, _) in self.vision_keys.items()}
        return {**values, self.block_indexes_key: list(getattr(vision, self.block_indexes_key)),
                "rope_theta": vision.rope_theta}

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Any:
        problems: list[str] = []
        vision_config = config.get("vision_config")
        if not isinstance(vision_config, Mapping):
            problems.append("vision_config: missing (not a vision-language checkpoint)")
            vision_config = {}
        vision_class = self.vision_class
        vision = {}
        for key, (field, kind) in self.vision_keys.items():
            spelled = self.vision_key_spellings.get(key, key) if key not in vision_config else key
            vision[field] = read_value(vision_config, spelled, kind, problems,
                                       default=vision_class.__dataclass_fields__[field].default,
                                       prefix="vision_config.")
        index_key = self.block_indexes_key
        indexes = vision_config.get(index_key, list(getattr(vision_class, index_key)))
        if not isinstance(indexes, (list, tuple)) or not all(isinstance(i, int) for i in indexes):
            problems.append(f"vision_config.{index_key}={indexes!r}: must be a list of block indexes")
        else:
            vision[index_key] = tuple(indexes)
        rope = vision_config.get("rope_parameters") or {}
        vision["rope_theta"] = float(rope.get("rope_theta", vision_class.rope_theta)) if isinstance(rope, Mapping) \
            else vision_class.rope_theta
        section = _mrope_section(config)
        if section is None:
            section = list(self.args_class.mrope_section)
        if not isinstance(section, list) or not all(isinstance(s, int) for s in section):
            problems.append(f"mrope_section={section!r}: must be a list of 3 ints")
        image_token = read_value(config, "image_token_id", int, problems, default=self.args_class.image_token_id)
        try:
            text = super().args_from_hf_config(_text_config(config, self.model_type), **overrides)
        except UserError as e:
            problems.append(str(e).removeprefix(f"unsupported Hugging Face {self.model_type} config: "))
        if problems:
            raise UserError(f"unsupported Hugging Face {self.model_type} config: " + "; ".join(problems))
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(LlamaArgs)}
        try:
            return self.args_class(**fields, vision=vision_class(**vision), image_token_id=image_token,
                                   mrope_section=tuple(section))
        except ValueError as e:
            raise UserError(f"Hugging Face {self.model_type} config: {e}") from None

    def hf_config_from_args(self, args: Any, dtype: torch.dtype, *,
                            base_config: Optional[Mapping[str, Any]] = None, **token_ids: Any) -> dict[str, Any]:
        base = dict(base_config or {})
        text = super().hf_config_from_args(args, dtype, base_config=_text_config(base, self.model_type),
                                           **token_ids)
        theta = text.pop("rope_theta")
        text.pop("rope_scaling", None)
        text.pop("architectures")
        for key in self.family_architecture(args):  # the multimodal keys are the top level's and the tower's
            text.pop(key)
        text.update(model_type=f"{self.model_type}_text", rope_parameters={
            "rope_type": "default", "rope_theta": theta, "mrope_section": list(args.mrope_section),
            **self.text_rope_extra})
        vision = {**(base.get("vision_config") or {}), **self._vision_architecture(args.vision)}
        for spelling in self.vision_key_spellings.values():
            vision.pop(spelling, None)
        vision.update(model_type=f"{self.model_type}_vision", hidden_act=vision.pop("hidden_act"),
                      rope_parameters={"rope_type": "axial", "rope_theta": vision.pop("rope_theta")})
        top = {k: v for k, v in base.items() if k not in text and k not in ("rope_scaling", "torch_dtype")}
        top.update({key: base.get(key, default) for key, default in _TOP_LEVEL_TOKENS.items()})
        top.update(architectures=[self.architecture_name], model_type=self.model_type, text_config=text,
                   vision_config=vision, image_token_id=args.image_token_id, tie_word_embeddings=args.tie_embeddings,
                   dtype=text["dtype"])
        return top

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        vision = {f"vision_config.{k}": v for k, v in self._vision_architecture(args.vision).items()}
        return {"mrope_section": list(args.mrope_section), "image_token_id": args.image_token_id, **vision}


HF = Qwen2_5_VLHFAdapter(
    model_type="qwen2_5_vl",
    architecture_name="Qwen2_5_VLForConditionalGeneration",
    variant={"qkv_bias": True},
    refusals=(Refusal("use_sliding_window", refuse_truthy("sliding-window attention is not supported")),),
    extra_config={"use_sliding_window": False, "sliding_window": None},
)


PARTS = VisionParts(tower=("visual.patch_embed", "visual.blocks"), projector=("visual.merger",),
                    tower_blocks="visual.blocks", shard_groups=(("visual.patch_embed",), ("visual.merger",)))
FAMILY = vision_family(
    __name__, "qwen2_5_vl", Qwen2_5_VL, HF,
    {
        "qwen2_5_vl_3b": (QWEN2_5_VL_3B, "Qwen2.5-VL 3B (3,754,622,976 parameters, tied embeddings)."),
        "qwen2_5_vl_7b": (QWEN2_5_VL_7B, "Qwen2.5-VL 7B (8,292,166,656 parameters)."),
        "qwen2_5_vl_tiny": (QWEN2_5_VL_TINY,
                            "A tiny Qwen2.5-VL for CI, of the embedded processor's sizes (tied embeddings)."),
    },
    PARTS,
    freeze_doc=(" ``freeze_vision_tower``: the tower's patch embedding and blocks are not trained; "
                "``freeze_projector``: nor is the merger."),
    vision_modules=("visual",),
    images=ImageInputs(resized=lambda args, height, width: resized_image(args.vision, height, width),
                       batch=planned_image_inputs, default_max_pixels=PROCESSOR_MAX_PIXELS),
)
build, freeze_ = FAMILY.build, PARTS.freeze_
# The builders are names of this module too (``torchtune_ac.models.families.qwen2_5_vl.qwen2_5_vl_7b``).
globals().update(FAMILY.builders)
