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
from typing import Any, Mapping

import torch
from torch import nn

from torchtune_ac.component_marker import config_component
from torchtune_ac.errors import UserError
from torchtune_ac.models.family import ModelFamily
from torchtune_ac.models.families.qwen2_5_vl import Qwen2_5_VLHFAdapter
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


class Qwen3_VLHFAdapter(Qwen2_5_VLHFAdapter):
    """Qwen3-VL's config.json and tensor names: Qwen2.5-VL's, over Qwen3-VL's tower and its interleaved RoPE."""

    display_name = "Qwen3-VL"
    args_class = Qwen3_VLArgs
    vision_class = VisionArgs
    vision_keys = _VISION_KEYS
    vision_key_spellings = {}
    block_indexes_key = "deepstack_visual_indexes"
    text_rope_extra = {"mrope_interleaved": True}

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        return {} if "head_dim" in config else {"head_dim": _HEAD_DIM}


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
)
# The builders are names of this module too (``torchtune_ac.models.families.qwen3_vl.qwen3_vl_8b``).
globals().update(FAMILY.builders)
