"""The gpt-oss family: builders (published shapes, exact parameter counts), config.json translation, YaRN, and
the published MXFP4 expert weights dequantised on load as transformers dequantises them. Logits, round trip and AC
against transformers' GptOssForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``."""

import json
import warnings

import pytest
import torch
from hf_families import write_hf_checkpoint
from numerics import assert_close
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from torch.nn.attention.flex_attention import flex_attention
from transformers import GptOssConfig

import torchtune_ac.models.families.gpt_oss as gpt_oss
from torchtune_ac.errors import UserError
from torchtune_ac.models import GPT_OSS, family_for_hf_config, load_hf, save_hf
from torchtune_ac.models.attention import (
    _explicit_attention,
    _per_document_attention,
    document_runs,
    flex_explicit_attention,
)
from torchtune_ac.models.llama import Llama, compute_rope_inv_freq

PARAMETER_COUNTS = {"gpt_oss_20b": 20_914_757_184, "gpt_oss_120b": 116_829_156_672}
# openai/gpt-oss-20b's config.json (the keys that matter).
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 150000,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(gpt_oss, name)()
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]


def test_the_published_config_json_translates_to_the_builder_args():
    assert family_for_hf_config(PUBLISHED_20B) is GPT_OSS
    assert GPT_OSS.hf.args_from_hf_config(PUBLISHED_20B) == gpt_oss.GPT_OSS_20B


def test_yarn_frequencies_and_attention_factor_are_transformers():
    args = gpt_oss.GPT_OSS_20B
    config = GptOssConfig(**{k: v for k, v in PUBLISHED_20B.items() if k != "quantization_config"})
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    # The same float32 formula, term for term: equal bit for bit.
    assert torch.equal(compute_rope_inv_freq(64, args.rope_theta, args.rope_scaling), expected)
    assert args.rope_scaling.resolved_attention_factor == factor


def test_attention_bias_false_is_refused():
    with pytest.raises(UserError, match="attention_bias=False: gpt-oss has attention biases"):
        GPT_OSS.hf.args_from_hf_config({**PUBLISHED_20B, "attention_bias": False})


def _quantize_experts(checkpoint, generator):
    """Replace every expert weight of a checkpoint by random MXFP4 blocks and scales, as published; the blocks and
    scales by name."""
    weights = load_file(checkpoint / "model.safetensors")
    packed = {}
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = weights.pop(name).shape  # [E, in, out] -> stored [E, out, in / 32, 16]
        packed[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                                                 generator=generator)
        packed[f"{name}_scales"] = torch.randint(120, 132, (experts, rows, cols // 32), dtype=torch.uint8,
                                                 generator=generator)
    save_file({**weights, **packed}, checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"] = PUBLISHED_20B["quantization_config"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    return packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_are_dequantised_on_load_as_transformers_does(tmp_path, dtype):
    # Expert weights of 32 x 32: one MXFP4 block per row.
    write_hf_checkpoint("gpt_oss", tmp_path / "mxfp4", seed=4, intermediate_size=32)
    packed = _quantize_experts(tmp_path / "mxfp4", torch.Generator().manual_seed(0))
    model = load_hf(tmp_path / "mxfp4", dtype=dtype)
    for layer in range(2):
        experts = model.layers[layer].mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            stored = f"model.layers.{layer}.mlp.experts.{name}"
            expected = convert_moe_packed_tensors(packed[f"{stored}_blocks"], packed[f"{stored}_scales"],
                                                  dtype=torch.float32)
            # Exact: every value is a 4-bit float times a power of two, in both dtypes.
            assert torch.equal(getattr(experts, name).float(), expected), stored
    save_hf(model, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert "quantization_config" not in saved
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "saved" / "model.safetensors")


def test_mxfp4_weights_without_their_scales_are_refused(tmp_path):
    write_hf_checkpoint("gpt_oss", tmp_path, seed=4, intermediate_size=32)
    _quantize_experts(tmp_path, torch.Generator().manual_seed(0))
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="missing tensor model.layers.1.mlp.experts.down_proj_scales"):
        load_hf(tmp_path)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_flex_attention_with_sinks_computes_the_explicit_kernels_attention(packed):
    """gpt-oss's CUDA path (FlexAttention, its output rescaled through its log-sum-exp for the sinks) against the
    explicit scores (the sink a logit of each head's softmax), forward, uncompiled on the CPU (where FlexAttention
    has no backward), grouped K/V and a window within packed documents."""
    generator = torch.Generator().manual_seed(4)
    b, s, hd = 2, 24, 16
    q = torch.randn(b, 4, s, hd, generator=generator)
    k, v = (torch.randn(b, 2, s, hd, generator=generator) for _ in range(2))
    sinks = torch.randn(4, generator=generator) * 2
    runs = document_runs(torch.tensor([[0] * 7 + [1] * 17, [0] * 20 + [1] * 4])) if packed else None
    options = dict(gqa=True, scale=None, window=5)

    def explicit(sinks):
        if packed:
            return _per_document_attention(q, k, v, runs=runs, dropout_p=0.0, sinks=sinks, **options)
        return _explicit_attention(q, k, v, dropout_p=0.0, sinks=sinks, **options).transpose(1, 2)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")  # meant: unfused here
        actual = flex_explicit_attention(q, k, v, runs=runs, kernel=flex_attention, sinks=sinks, **options)
    expected = explicit(sinks)
    assert_close(actual, expected, terms=hd + 2 * s, what="attention with sinks")
    assert (expected - explicit(None)).abs().max() > 1e-2  # the sinks take a visible share
