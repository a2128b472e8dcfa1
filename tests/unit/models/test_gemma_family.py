"""The Gemma (1) family: builders (published shapes, exact parameter counts) and config.json translation. Logits,
round trip and AC against transformers' GemmaForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``;
its block on 2 processes against 1 is Gemma 3's less the q/k and post-norms (Gemma 3 in
``tests/integration/test_distributed.py``)."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoConfig

import torchtune_ac.models.families.gemma as gemma
from torchtune_ac.errors import UserError
from torchtune_ac.models import GEMMA, family_for_hf_config, family_of

PARAMETER_COUNTS = {"gemma_2b": 2_506_172_416, "gemma_7b": 8_537_680_896}
# The config.json files published with the models (the keys that matter: no tie_word_embeddings, legacy gelu).
_COMMON = {"architectures": ["GemmaForCausalLM"], "model_type": "gemma", "attention_bias": False,
           "attention_dropout": 0.0, "head_dim": 256, "hidden_act": "gelu", "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "vocab_size": 256000}
PUBLISHED_CONFIGS = {
    "gemma_2b": {**_COMMON, "hidden_size": 2048, "intermediate_size": 16384, "num_attention_heads": 8,
                 "num_hidden_layers": 18, "num_key_value_heads": 1},
    "gemma_7b": {**_COMMON, "hidden_size": 3072, "intermediate_size": 24576, "num_attention_heads": 16,
                 "num_hidden_layers": 28, "num_key_value_heads": 16},
}


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(gemma, name)()
    assert family_of(model) is GEMMA
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    assert model.args.resolved_head_dim == 256


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_config_json_translates_to_builder_args(name):
    config = PUBLISHED_CONFIGS[name]
    assert family_for_hf_config(config) is GEMMA
    assert GEMMA.hf.args_from_hf_config(config) == getattr(gemma, name.upper())


def test_transformers_reads_our_config_as_tied_gelu_tanh(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA.hf.hf_config_from_args(gemma.GEMMA_7B, torch.bfloat16)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "GemmaConfig"
    assert (hf.hidden_act, hf.tie_word_embeddings, hf.head_dim) == ("gelu_pytorch_tanh", True, 256)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "relu"}, "hidden_act='relu': only 'gelu_pytorch_tanh' is supported"),
        ({"attention_bias": True}, "attention_bias=True: gemma projections with biases are not supported"),
    ],
)
def test_unsupported_gemma_configs_name_the_key(change, message):
    with pytest.raises(UserError, match="unsupported Hugging Face gemma config") as info:
        GEMMA.hf.args_from_hf_config({**PUBLISHED_CONFIGS["gemma_2b"], **change})
    assert message in str(info.value)


def test_a_gemma_model_needs_its_offset_norms():
    with pytest.raises(ValueError, match=r"norm_offset=0.0, but gemma has norm_offset=1.0 \(norms scaling by"):
        GEMMA.build(dataclasses.replace(gemma.GEMMA_2B, norm_offset=0.0))
