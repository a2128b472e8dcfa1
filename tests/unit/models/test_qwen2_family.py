"""The Qwen2 family: Qwen2.5 builders (published shapes, exact parameter counts) and config.json translation."""

import dataclasses
import inspect
import json

import pytest
import torch
from transformers import AutoConfig

import torchtune_ac.models.families.qwen2 as qwen2
from torchtune_ac.errors import UserError
from torchtune_ac.models import QWEN2, family_for_hf_config, family_of

PARAMETER_COUNTS = {"qwen2_5_0_5b": 494_032_768, "qwen2_5_1_5b": 1_543_714_304, "qwen2_5_7b": 7_615_616_512}
# The config.json files published with the base models (the keys that matter).
PUBLISHED_CONFIGS = {
    "qwen2_5_0_5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
        "use_mrope": False, "vocab_size": 151936, "attention_dropout": 0.0,
    },
    "qwen2_5_7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 131072, "max_window_layers": 28,
        "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "use_sliding_window": False, "use_mrope": False, "vocab_size": 152064, "attention_dropout": 0.0,
    },
}


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(qwen2, name)()
    assert family_of(model) is QWEN2
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_builders_share_the_builder_signature_and_pass_its_arguments(name):
    params = inspect.signature(getattr(qwen2, name)).parameters
    assert list(params) == ["attn_dropout", "resid_dropout", "max_seq_len"]
    with torch.device("meta"):
        model = getattr(qwen2, name)(attn_dropout=0.1, max_seq_len=256)
    base = getattr(qwen2, name.upper())
    assert model.args == dataclasses.replace(base, attn_dropout=0.1, max_seq_len=256)
    assert base.qkv_bias


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_config_json_translates_to_builder_args(name):
    config = PUBLISHED_CONFIGS[name]
    assert family_for_hf_config(config) is QWEN2
    assert QWEN2.hf.args_from_hf_config(config) == getattr(qwen2, name.upper())


def test_transformers_reads_our_config_as_full_attention_with_biases(tmp_path):
    config = QWEN2.hf.hf_config_from_args(qwen2.QWEN2_5_0_5B, torch.bfloat16)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Qwen2Config"
    assert set(hf.layer_types) == {"full_attention"}
    assert (hf.hidden_size, hf.num_key_value_heads, hf.tie_word_embeddings) == (896, 2, True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window=True: sliding-window attention is not supported"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "only full attention in every layer"),
        ({"use_mrope": True}, "use_mrope=True: multimodal RoPE"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ],
)
def test_unsupported_qwen2_configs_name_the_key(change, message):
    with pytest.raises(UserError, match="unsupported Hugging Face qwen2 config") as info:
        QWEN2.hf.args_from_hf_config({**PUBLISHED_CONFIGS["qwen2_5_0_5b"], **change})
    assert message in str(info.value)


def test_a_qwen2_model_needs_its_biases():
    with pytest.raises(ValueError, match="qkv_bias=True"):
        QWEN2.build(dataclasses.replace(qwen2.QWEN2_5_0_5B, qkv_bias=False))
