"""The Qwen3 family: builders (published shapes, exact parameter counts) and config.json translation. Logits,
round trip and AC against transformers' Qwen3ForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``;
tensor parallelism on 2 ranks against 1 process in ``tests/unit/training/test_tensor_parallel.py`` (q/k norms through
tune run on 2 processes: Gemma 3's and Qwen3-MoE's in ``tests/integration/test_distributed.py``)."""

import dataclasses
import inspect
import json

import pytest
import torch
from hf_families import write_hf_checkpoint
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import torchtune_ac.models.families.qwen3 as qwen3
from torchtune_ac.errors import UserError
from torchtune_ac.models import QWEN3, family_for_hf_config, family_of, load_hf

PARAMETER_COUNTS = {"qwen3_0_6b": 596_049_920, "qwen3_1_7b": 1_720_574_976, "qwen3_4b": 4_022_468_096,
                    "qwen3_8b": 8_190_735_360, "qwen3_14b": 14_768_307_200, "qwen3_32b": 32_762_123_264}
_COMMON = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
           "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960,
           "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
           "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936}
# The config.json files published with the models (the keys that matter).
PUBLISHED_CONFIGS = {
    "qwen3_0_6b": {**_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "max_window_layers": 28, "tie_word_embeddings": True},
    "qwen3_8b": {**_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "max_window_layers": 36, "tie_word_embeddings": False},
    "qwen3_32b": {**_COMMON, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "max_window_layers": 64, "tie_word_embeddings": False},
}


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(qwen3, name)()
    assert family_of(model) is QWEN3
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    assert model.args.resolved_head_dim == 128 and model.args.qk_norm


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_builders_share_the_builder_signature_and_pass_its_arguments(name):
    assert list(inspect.signature(getattr(qwen3, name)).parameters) == ["attn_dropout", "resid_dropout", "max_seq_len"]
    with torch.device("meta"):
        model = getattr(qwen3, name)(attn_dropout=0.1, max_seq_len=32_768)
    assert model.args == dataclasses.replace(getattr(qwen3, name.upper()), attn_dropout=0.1, max_seq_len=32_768)


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_config_json_translates_to_builder_args(name):
    config = PUBLISHED_CONFIGS[name]
    assert family_for_hf_config(config) is QWEN3
    assert QWEN3.hf.args_from_hf_config(config) == getattr(qwen3, name.upper())
    # transformers' Qwen3Config has head_dim 128 when config.json has none: so do we.
    without = {key: value for key, value in config.items() if key != "head_dim"}
    assert QWEN3.hf.args_from_hf_config(without).resolved_head_dim == 128


def test_transformers_reads_our_config_as_full_attention_with_q_k_norms(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3.hf.hf_config_from_args(qwen3.QWEN3_0_6B, torch.bfloat16)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Qwen3Config"
    assert set(hf.layer_types) == {"full_attention"}
    assert (hf.hidden_size, hf.head_dim, hf.num_key_value_heads, hf.tie_word_embeddings) == (1024, 128, 8, True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sliding_window": True}, "use_sliding_window=True: sliding-window attention is not supported"),
        ({"attention_bias": True}, "attention_bias=True: qwen3 projections with biases are not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu': only 'silu' is supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
    ],
)
def test_unsupported_qwen3_configs_name_the_key(change, message):
    with pytest.raises(UserError, match="unsupported Hugging Face qwen3 config") as info:
        QWEN3.hf.args_from_hf_config({**PUBLISHED_CONFIGS["qwen3_0_6b"], **change})
    assert message in str(info.value)


def test_a_qwen3_model_needs_its_q_k_norms():
    with pytest.raises(ValueError, match="qk_norm=False, but qwen3 has q/k norms"):
        QWEN3.build(dataclasses.replace(qwen3.QWEN3_0_6B, qk_norm=False))


def test_a_tied_checkpoint_that_stores_lm_head_loads_when_it_equals_the_embedding(tmp_path):
    checkpoint = write_hf_checkpoint("qwen3", tmp_path, seed=4, tie_word_embeddings=True)
    weights = load_file(checkpoint / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embedding.clone()}, checkpoint / "model.safetensors")
    assert torch.equal(load_hf(checkpoint).output.weight, embedding)
    save_file({**weights, "lm_head.weight": embedding + 1}, checkpoint / "model.safetensors")
    with pytest.raises(UserError, match="lm_head.weight differs from model.embed_tokens.weight, but the model ties"):
        load_hf(checkpoint)
