"""The Qwen3-VL family (dense): Qwen3's decoder with interleaved multimodal RoPE, and a vision tower whose merged
patches replace the image tokens' embeddings and whose DeepStack features join the first decoder layers
(``models/vision/qwen3_vl.py``).

Checkpoints: the decoder under ``model.language_model.``, the tower under ``model.visual.`` (as published and as
transformers 5 saves them); config.json nests ``text_config`` and ``vision_config``, the decoder's RoPE as
``rope_scaling`` (published) or ``rope_parameters`` (transformers 5) with ``mrope_section``: both are read, the
latter is written.

Activation checkpointing and FSDP2 see the tower's blocks, then the decoder's, as Qwen2.5-VL's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
from torch import nn

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError
from torchtune_ac.models.family import ImageInputs, ModelFamily
from torchtune_ac.models.families.qwen2_5_vl import PROCESSOR_MAX_PIXELS, Qwen2_5_VLHFAdapter
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, read_value
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.models.vision.qwen2_5_vl import planned_image_inputs, resized_image
from torchtune_ac.models.vision.qwen3_vl import Qwen3_VL, Qwen3_VLArgs, VisionArgs

QWEN3_VL_8B = Qwen3_VLArgs(
    vocab_size=151_936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, intermediate_dim=12_288, head_dim=None,
    max_seq_len=262_144, norm_eps=1e-6, rope_theta=5_000_000.0, tie_embeddings=False, model_type="qwen3_vl",
    qk_norm=True, vision=VisionArgs(out_dim=4096))
# For CI: the embedded tokenizer's vocabulary (518 tokens, ``<|image_pad|>`` 516), 16-pixel patches of 2 frames
# merged 2 x 2 (Qwen3-VL's processor), a 4 x 4 learned position grid, 3 tower blocks of which the first two feed
# DeepStack features to the first two of 3 decoder layers.
QWEN3_VL_TINY = Qwen3_VLArgs(
    vocab_size=518, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, intermediate_dim=128, max_seq_len=2048,
    norm_eps=1e-6, rope_theta=1_000_000.0, tie_embeddings=True, model_type="qwen3_vl", qk_norm=True,
    vision=VisionArgs(depth=3, dim=32, intermediate_dim=64, n_heads=2, out_dim=64, num_position_embeddings=16,
                      deepstack_visual_indexes=(0, 1)),
    image_token_id=516, mrope_section=(4, 2, 2))

_HEAD_DIM = 128  # Qwen3VLTextConfig's default, whatever the width and head count
# config.json ``vision_config`` key -> (``VisionArgs`` field, kind)
_VISION_KEYS = {
    "depth": ("depth", int), "hidden_size": ("dim", int), "intermediate_size": ("intermediate_dim", int),
    "num_heads": ("n_heads", int), "out_hidden_size": ("out_dim", int), "in_channels": ("in_channels", int),
    "patch_size": ("patch_size", int), "temporal_patch_size": ("temporal_patch_size", int),
    "spatial_merge_size": ("spatial_merge_size", int), "num_position_embeddings": ("num_position_embeddings", int),
    "hidden_act": ("activation", str),
}
_TOP_LEVEL_TOKENS = {"video_token_id": 151_656, "vision_start_token_id": 151_652, "vision_end_token_id": 151_653}
_MROPE_KEYS = ("type", "rope_type", "mrope_section", "mrope_interleaved")


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's keys of a config.json (top level, then ``text_config``), its RoPE as the default type."""
    text = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    text.update(config.get("text_config") or {})
    text["model_type"] = "qwen3_vl"
    for key in ("rope_parameters", "rope_scaling"):
        rope = text.get(key)
        if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) in ("mrope", "default"):
            text[key] = {k: v for k, v in rope.items() if k not in _MROPE_KEYS} or None
    if "tie_word_embeddings" in config:  # the top-level value is the model's
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def _mrope_section(config: Mapping[str, Any]) -> Any:
    for source in (config.get("text_config") or {}, config):
        for key in ("rope_parameters", "rope_scaling"):
            rope = source.get(key)
            if isinstance(rope, Mapping) and "mrope_section" in rope:
                return rope["mrope_section"]
    return None


def _vision_architecture(vision: VisionArgs) -> dict[str, Any]:
    values = {key: getattr(vision, field) for key, (field, _) in _VISION_KEYS.items()}
    return {**values, "deepstack_visual_indexes": list(vision.deepstack_visual_indexes),
            "rope_theta": vision.rope_theta}


class Qwen3_VLHFAdapter(Qwen2_5_VLHFAdapter):
    """Qwen3-VL's config.json and tensor names (Qwen2.5-VL's prefixes)."""

    def check_args(self, args: LlamaArgs) -> None:
        if not isinstance(args, Qwen3_VLArgs):
            raise ValueError(f"{type(args).__name__}: Qwen3-VL needs Qwen3_VLArgs (a vision tower)")
        LlamaStyleHFAdapter.check_args(self, args)

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        return {} if "head_dim" in config else {"head_dim": _HEAD_DIM}

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> Qwen3_VLArgs:
        problems: list[str] = []
        vision_config = config.get("vision_config")
        if not isinstance(vision_config, Mapping):
            problems.append("vision_config: missing (not a vision-language checkpoint)")
            vision_config = {}
        vision = {field: read_value(vision_config, key, kind, problems,
                                    default=VisionArgs.__dataclass_fields__[field].default, prefix="vision_config.")
                  for key, (field, kind) in _VISION_KEYS.items()}
        indexes = vision_config.get("deepstack_visual_indexes", list(VisionArgs.deepstack_visual_indexes))
        if not isinstance(indexes, (list, tuple)) or not all(isinstance(i, int) for i in indexes):
            problems.append(f"vision_config.deepstack_visual_indexes={indexes!r}: must be a list of block indexes")
        else:
            vision["deepstack_visual_indexes"] = tuple(indexes)
        rope = vision_config.get("rope_parameters") or {}
        vision["rope_theta"] = float(rope.get("rope_theta", VisionArgs.rope_theta)) if isinstance(rope, Mapping) \
            else VisionArgs.rope_theta
        section = _mrope_section(config)
        if section is None:
            section = list(Qwen3_VLArgs.mrope_section)
        if not isinstance(section, list) or not all(isinstance(s, int) for s in section):
            problems.append(f"mrope_section={section!r}: must be a list of 3 ints")
        image_token = read_value(config, "image_token_id", int, problems, default=Qwen3_VLArgs.image_token_id)
        try:
            text = LlamaStyleHFAdapter.args_from_hf_config(self, _text_config(config), **overrides)
        except UserError as e:
            problems.append(str(e).removeprefix("unsupported Hugging Face qwen3_vl config: "))
        if problems:
            raise UserError("unsupported Hugging Face qwen3_vl config: " + "; ".join(problems))
        fields = {f.name: getattr(text, f.name) for f in dataclasses.fields(LlamaArgs)}
        try:
            return Qwen3_VLArgs(**fields, vision=VisionArgs(**vision), image_token_id=image_token,
                                mrope_section=tuple(section))
        except ValueError as e:
            raise UserError(f"Hugging Face qwen3_vl config: {e}") from None

    def hf_config_from_args(self, args: Qwen3_VLArgs, dtype: torch.dtype, *,
                            base_config: Optional[Mapping[str, Any]] = None, **token_ids: Any) -> dict[str, Any]:
        base = dict(base_config or {})
        text = LlamaStyleHFAdapter.hf_config_from_args(self, args, dtype, base_config=_text_config(base),
                                                       **token_ids)
        theta = text.pop("rope_theta")
        text.pop("rope_scaling", None)
        text.pop("architectures")
        for key in self.family_architecture(args):  # the multimodal keys are the top level's and the tower's
            text.pop(key)
        text.update(model_type="qwen3_vl_text", rope_parameters={
            "rope_type": "default", "rope_theta": theta, "mrope_section": list(args.mrope_section),
            "mrope_interleaved": True})
        vision = {**(base.get("vision_config") or {}), **_vision_architecture(args.vision)}
        vision.update(model_type="qwen3_vl_vision", hidden_act=vision.pop("hidden_act"),
                      rope_parameters={"rope_type": "axial", "rope_theta": vision.pop("rope_theta")})
        top = {k: v for k, v in base.items() if k not in text and k not in ("rope_scaling", "torch_dtype")}
        top.update({key: base.get(key, default) for key, default in _TOP_LEVEL_TOKENS.items()})
        top.update(architectures=[self.architecture_name], model_type=self.model_type, text_config=text,
                   vision_config=vision, image_token_id=args.image_token_id, tie_word_embeddings=args.tie_embeddings,
                   dtype=text["dtype"])
        return top

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        vision = {f"vision_config.{k}": v for k, v in _vision_architecture(args.vision).items()}
        return {"mrope_section": list(args.mrope_section), "image_token_id": args.image_token_id, **vision}


HF = Qwen3_VLHFAdapter(
    model_type="qwen3_vl",
    architecture_name="Qwen3VLForConditionalGeneration",
    variant={"qk_norm": True},
    extra_config={"attention_bias": False},
)


def build(args: Qwen3_VLArgs) -> Qwen3_VL:
    HF.check_args(args)
    return Qwen3_VL(args)


def freeze_(model: Qwen3_VL, *, vision_tower: bool, projector: bool) -> Qwen3_VL:
    """Stop training the tower (patch and position embeddings, blocks) and/or the projectors (the merger and the
    DeepStack mergers)."""
    if vision_tower:
        for module in (model.visual.patch_embed, model.visual.pos_embed, model.visual.blocks):
            module.requires_grad_(False)
    if projector:
        model.visual.merger.requires_grad_(False)
        model.visual.deepstack_merger_list.requires_grad_(False)
    return model


def _builder(name: str, base: Qwen3_VLArgs, doc: str):
    def builder(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None,
                freeze_vision_tower: bool = False, freeze_projector: bool = False) -> Qwen3_VL:
        try:
            args = dataclasses.replace(base, attn_dropout=attn_dropout, resid_dropout=resid_dropout,
                                       max_seq_len=base.max_seq_len if max_seq_len is None else max_seq_len)
        except ValueError as e:
            raise UserError(f"model {name}: {e}") from None
        return freeze_(build(args), vision_tower=freeze_vision_tower, projector=freeze_projector)

    builder.__module__, builder.__name__, builder.__qualname__ = __name__, name, name
    builder.__doc__ = doc + (" ``freeze_vision_tower``: the tower's patch and position embeddings and blocks are "
                             "not trained; ``freeze_projector``: nor are the merger and the DeepStack mergers.")
    return config_component(builder)


def _blocks(model: nn.Module) -> nn.ModuleList:
    return nn.ModuleList([*model.visual.blocks, *model.layers])


def _shard_groups(model: nn.Module) -> tuple[tuple[nn.Module, ...], ...]:
    visual = model.visual  # each DeepStack merger runs after its block, the merger after the last block
    vision = ((visual.patch_embed, visual.pos_embed), *((merger,) for merger in visual.deepstack_merger_list),
              (visual.merger,))
    if model.args.tie_embeddings:
        return vision
    return (*vision, (model.tok_embeddings,), (model.norm, model.output))


def _init_parameter(model: nn.Module, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    model.init_parameter_(name, tensor, generator)


FAMILY = ModelFamily(
    name="qwen3_vl",
    model_class=Qwen3_VL,
    builders={
        "qwen3_vl_8b": _builder("qwen3_vl_8b", QWEN3_VL_8B, "Qwen3-VL 8B (8,767,123,696 parameters)."),
        "qwen3_vl_tiny": _builder("qwen3_vl_tiny", QWEN3_VL_TINY,
                                  "A tiny Qwen3-VL for CI, of the embedded tokenizer's vocabulary (tied embeddings)."),
    },
    hf=HF,
    args_of=lambda model: model.args,
    build=build,
    blocks=_blocks,
    shard_groups=_shard_groups,
    vision_modules=("visual",),
    init_weights=lambda model: model.init_weights(),
    init_parameter=_init_parameter,
    # Qwen2.5-VL's layout and rounding: the same processor (Qwen2VLImageProcessor), its merge unit 32 pixels.
    images=ImageInputs(resized=lambda args, height, width: resized_image(args.vision, height, width),
                       batch=planned_image_inputs, default_max_pixels=PROCESSOR_MAX_PIXELS),
)
# The builders are names of this module too (``torchtune_ac.models.families.qwen3_vl.qwen3_vl_8b``).
globals().update(FAMILY.builders)
