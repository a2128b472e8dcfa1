"""Tiny random models and checkpoints of every supported family, made with transformers' own classes (nothing
is downloaded): the reference our families must match."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

GEMMA3_TINY = {
    "head_dim": 16, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}
# Every variant Phi-3's family reads: a sliding window, partial rotary embeddings (half of each head), and LongRoPE
# with an original length the 20-token rows pass (their long factors) and 10-token documents do not (short ones).
# No pad or end token: Phi-3's defaults (32000) are beyond the tiny vocabulary.
PHI3_TINY = {
    "sliding_window": 6, "original_max_position_embeddings": 16, "pad_token_id": None, "eos_token_id": None,
    "rope_parameters": {"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5,
                        "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0]},
}
# Gemma 2's pattern (a sliding layer, 6 tokens, then a global one), its attention scale, and caps low enough to
# bend the tiny model's scores and logits (random weights give scores of a few units; the published caps, 50 and
# 30, would leave them almost linear and a missing cap unseen).
GEMMA2_TINY = {"head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 1.5}
# A dense layer (mlp_only_layers) before a sparse one, 4 experts of 16 (rows of 64 bytes: torch._grouped_mm's
# alignment), 2 per token, renormalised.
QWEN3_MOE_TINY = {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "norm_topk_prob": True, "mlp_only_layers": [0]}
# gpt-oss: a sliding layer (a 6-token window) then a full one, YaRN as published, 4 experts of 16, 2 per token, and
# a SwiGLU limit of 0.5 that the random activations reach (7.0, published, they would not).
GPT_OSS_TINY = {"head_dim": 16, "intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 6, "swiglu_limit": 0.5}
# Qwen2.5-VL: the decoder of TINY_SHAPE with multimodal RoPE (head_dim 8: 2 + 1 + 1 rotated pairs), and a tower of
# 2 blocks (a windowed one, then a full one) with the embedded processor's patch (14), merge (2) and temporal patch
# (2) sizes. Windows of 56 pixels are 2 x 2 merge units, so an image of 4 x 8 patches has 2 windows and one of
# 6 x 4 a window cut short. The vocabulary has 4 tokens beyond TINY_SHAPE's random token range: the image
# placeholder (98) is never drawn in a text-only batch.
QWEN2_5_VL_TINY = {
    "vocab_size": 100, "bos_token_id": 1, "eos_token_id": 2, "image_token_id": 98, "video_token_id": 99,
    "vision_start_token_id": 96, "vision_end_token_id": 97, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1],
                                                   "rope_theta": 10_000.0},
    "vision_config": {"depth": 2, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 32,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                      "fullatt_block_indexes": [1]},
}
# Qwen3-VL: a decoder of 3 layers (head_dim 16: 4 + 2 + 2 rotated pairs, rows and columns interleaved at pairs 1, 4
# and 2, 5), and a tower of 3 blocks whose first two feed DeepStack features to the first two decoder layers, a
# 4 x 4 learned position grid (resampled to every image's), 16-pixel patches. Its keys are nested as transformers
# 5 nests them; the image tokens as QWEN2_5_VL_TINY's.
QWEN3_VL_TINY = {
    "text_config": {"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "mrope_section": [4, 2, 2],
                                        "mrope_interleaved": True}},
    "vision_config": {"depth": 3, "hidden_size": 16, "intermediate_size": 24, "num_heads": 2, "out_hidden_size": 32,
                      "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1], "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
    "image_token_id": 98, "video_token_id": 99, "vision_start_token_id": 96, "vision_end_token_id": 97,
}
# family -> (config class, model class, config settings that make transformers build exactly our architecture)
HF_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    # head_dim 16 with 4 heads of a 32-wide model: decoupled from hidden / heads, as Qwen3's 128 is.
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16, "use_sliding_window": False}),
    # Every part of Gemma 3's attention pattern: a sliding layer (a 6-token window, shorter than the rows tested)
    # with its own RoPE base, then a global layer with linear RoPE scaling; its own attention scale.
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA3_TINY),
    "gemma": (GemmaConfig, GemmaForCausalLM, {"head_dim": 16}),
    "phi3": (Phi3Config, Phi3ForCausalLM, PHI3_TINY),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, GEMMA2_TINY),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, QWEN3_MOE_TINY),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, GPT_OSS_TINY),
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, QWEN2_5_VL_TINY),
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration, QWEN3_VL_TINY),
}
FAMILY_NAMES = sorted(HF_CLASSES)
# Families whose norms scale by (1 + weight).
OFFSET_NORMS = ("gemma", "gemma2", "gemma3")
TINY_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def randomize_(model: torch.nn.Module, seed: int, norm_offset: float = 0.0) -> None:
    """Random weights everywhere, including norm scales and biases (left at 1 or 0 they would hide a swapped
    name). Norms scale by 0.5 to 1.5: with ``norm_offset`` 1 (Gemma's ``1 + w``), their weights are -0.5 to 0.5."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5 - norm_offset)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def random_hf_model(family: str, seed: int = 0, **config: object) -> PreTrainedModel:
    """A random transformers model of ``family`` (eager attention, fp32, eval mode); ``config`` overrides
    ``TINY_SHAPE`` and any config key (``tie_word_embeddings``, ``rope_theta``, ...)."""
    config_class, model_class, required = HF_CLASSES[family]
    hf_config = config_class(**{**TINY_SHAPE, **required, **config}, attn_implementation="eager")
    model = model_class(hf_config)
    randomize_(model, seed, norm_offset=1.0 if family in OFFSET_NORMS else 0.0)
    return model.eval()


def write_hf_checkpoint(family: str, out_dir: Path, seed: int = 0, **config: object) -> Path:
    """``random_hf_model(...)`` saved by transformers (safetensors) into ``out_dir``."""
    random_hf_model(family, seed, **config).save_pretrained(out_dir)
    return out_dir


# The published Qwen2.5-VL files' tensor prefixes (transformers 4) for transformers 5's.
QWEN2_5_VL_LEGACY_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def write_tiny_vlm_checkpoint(out_dir: Path, seed: int = 0, *, legacy_layout: bool = False,
                              **config: object) -> Path:
    """A tiny random Qwen2.5-VL (``QWEN2_5_VL_TINY``; ``config`` overrides any key) saved by transformers into
    ``out_dir``. ``legacy_layout``: its tensors renamed to the published files' layout (``model.``, ``visual.``) and
    its config.json flat (the decoder's keys at the top, ``rope_scaling`` of type ``mrope``), as Qwen publishes."""
    from safetensors.torch import load_file, save_file

    write_hf_checkpoint("qwen2_5_vl", out_dir, seed, **config)
    if legacy_layout:
        path = out_dir / "model.safetensors"
        tensors = load_file(path)
        renamed = {}
        for name, tensor in tensors.items():
            for new, old in QWEN2_5_VL_LEGACY_PREFIXES:
                if name.startswith(new):
                    name = old + name[len(new):]
                    break
            renamed[name] = tensor
        save_file(renamed, path, metadata={"format": "pt"})
        nested = json.loads((out_dir / "config.json").read_text())
        text = nested.pop("text_config")
        rope = text.pop("rope_parameters")
        flat = {**text, **nested, "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
                "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
        flat["vision_config"]["in_chans"] = flat["vision_config"].pop("in_channels")
        (out_dir / "config.json").write_text(json.dumps(flat))
    return out_dir


# Values other than transformers' defaults, so a field that is rebuilt instead of kept shows.
CUSTOM_FIELDS = {"pad_token_id": 5, "initializer_range": 0.05, "use_cache": False, "bos_token_id": 1,
                 "eos_token_id": [2, 7]}
FAMILY_FIELDS = {"llama": {"pretraining_tp": 1}, "qwen2": {"max_window_layers": 1}}
# What the saved config.json states in its own spelling: rope_parameters as rope_theta (+ rope_scaling).
RESTATED = {"rope_parameters"}


def write_custom_config_checkpoint(family: str, out: Path, vocab_size: int = 96) -> dict:
    """A checkpoint like ``write_hf_checkpoint``'s whose config.json holds ``CUSTOM_FIELDS``; its parsed config.json."""
    write_hf_checkpoint(family, out, vocab_size=vocab_size, **CUSTOM_FIELDS, **FAMILY_FIELDS[family])
    return json.loads((out / "config.json").read_text())


def assert_config_kept(base: dict, saved: dict, changed: tuple[str, ...] = ()) -> None:
    """Every field of ``base`` is in ``saved`` with the same value, but those ``changed`` and those restated."""
    for key, value in base.items():
        if key in RESTATED or key in changed:
            continue
        assert key in saved, f"{key} dropped"
        assert saved[key] == value, f"{key}: {value!r} became {saved[key]!r}"
    assert saved["rope_theta"] == base["rope_parameters"]["rope_theta"]
    assert "rope_parameters" not in saved
