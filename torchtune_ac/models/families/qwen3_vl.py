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

from typing import Any, Mapping

from torchtune_ac.models.families import qwen2_5_vl
from torchtune_ac.models.families.qwen2_5_vl import Qwen2_5_VLHFAdapter
from torchtune_ac.models.vision.qwen3_vl import Qwen3_VL, Qwen3_VLArgs, VisionArgs
from torchtune_ac.models.vision_family import VisionParts, vision_family

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


# Each DeepStack merger runs after its block, the merger after the last block.
PARTS = VisionParts(tower=("visual.patch_embed", "visual.pos_embed", "visual.blocks"),
                    projector=("visual.merger", "visual.deepstack_merger_list"), tower_blocks="visual.blocks",
                    shard_groups=(("visual.patch_embed", "visual.pos_embed"), ("visual.deepstack_merger_list",),
                                  ("visual.merger",)))
FAMILY = vision_family(
    __name__, "qwen3_vl", Qwen3_VL, HF,
    {
        "qwen3_vl_8b": (QWEN3_VL_8B, "Qwen3-VL 8B (8,767,123,696 parameters)."),
        "qwen3_vl_tiny": (QWEN3_VL_TINY,
                          "A tiny Qwen3-VL for CI, of the embedded tokenizer's vocabulary (tied embeddings)."),
    },
    PARTS,
    freeze_doc=(" ``freeze_vision_tower``: the tower's patch and position embeddings and blocks are not trained; "
                "``freeze_projector``: nor are the merger and the DeepStack mergers."),
    vision_modules=("visual",),
    # Qwen2.5-VL's layout and rounding: the same processor (Qwen2VLImageProcessor), its merge unit 32 pixels.
    images=qwen2_5_vl.FAMILY.images,
)
build, freeze_ = FAMILY.build, PARTS.freeze_
# The builders are names of this module too (``torchtune_ac.models.families.qwen3_vl.qwen3_vl_8b``).
globals().update(FAMILY.builders)
