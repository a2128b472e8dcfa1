"""The Mistral family: the Mistral 7B v0.3 builder (published shape, exact parameter count) and config.json
translation."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig

from torchtune_ac.errors import UserError
from torchtune_ac.models import MISTRAL, family_for_hf_config, family_of, mistral_7b
from torchtune_ac.models.families.mistral import MISTRAL_7B

# The config.json published with Mistral-7B-v0.3 (the keys that matter).
PUBLISHED_V0_3 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 32768, "attention_dropout": 0.0,
}


def test_parameter_count_and_arguments_on_meta():
    with torch.device("meta"):
        model = mistral_7b(resid_dropout=0.1, max_seq_len=4096)
    assert family_of(model) is MISTRAL
    assert sum(p.numel() for p in model.parameters()) == 7_248_023_552
    assert model.args == dataclasses.replace(MISTRAL_7B, resid_dropout=0.1, max_seq_len=4096)


def test_published_config_json_translates_to_builder_args():
    assert family_for_hf_config(PUBLISHED_V0_3) is MISTRAL
    assert MISTRAL.hf.args_from_hf_config(PUBLISHED_V0_3) == MISTRAL_7B


def test_a_sliding_window_is_refused_naming_the_key():
    with pytest.raises(UserError, match="sliding_window=4096: sliding-window attention is not supported"):
        MISTRAL.hf.args_from_hf_config({**PUBLISHED_V0_3, "sliding_window": 4096})  # Mistral 7B v0.1


def test_transformers_reads_our_config_without_a_window(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL.hf.hf_config_from_args(MISTRAL_7B, torch.bfloat16)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "MistralConfig"
    assert hf.sliding_window is None
    assert (hf.head_dim, hf.num_key_value_heads, hf.rope_parameters["rope_theta"]) == (128, 8, 1_000_000.0)
