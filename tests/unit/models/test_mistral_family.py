"""The Mistral family: the Mistral 7B v0.3 builder (published shape, exact parameter count), config.json
translation, and Mistral 7B v0.1's sliding window against transformers."""

import dataclasses
import json

import pytest
import torch
from hf_families import random_hf_model
from transformers import AutoConfig, MistralForCausalLM

from torchtune_ac.errors import UserError
from torchtune_ac.models import (
    MISTRAL,
    family_for_hf_config,
    family_of,
    from_hf_config,
    load_hf,
    load_hf_weights_,
    mistral_7b,
    save_hf,
)
from torchtune_ac.models.families.mistral import MISTRAL_7B
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing

AC_MODES = {"none": {}, "full": {"ac_mode": "full"}, "every_2nd": {"ac_mode": "selective", "ac_option": 2},
            "per_op": {"ac_mode": "selective", "ac_option": "op"}}

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


def test_mistral_7b_v0_1_reads_its_sliding_window_in_every_layer():
    args = MISTRAL.hf.args_from_hf_config({**PUBLISHED_V0_3, "sliding_window": 4096})  # Mistral 7B v0.1's
    assert args == dataclasses.replace(MISTRAL_7B, sliding_window=4096)
    assert [args.window_of(layer) for layer in (0, 31)] == [4096, 4096]
    # Without the key, transformers builds its default window: so do we.
    absent = {key: value for key, value in PUBLISHED_V0_3.items() if key != "sliding_window"}
    assert MISTRAL.hf.args_from_hf_config(absent).sliding_window == 4096
    with pytest.raises(UserError, match="sliding_window='4096': must be int"):
        MISTRAL.hf.args_from_hf_config({**PUBLISHED_V0_3, "sliding_window": "4096"})


def test_a_window_is_part_of_the_architecture_a_checkpoint_is_checked_against():
    assert MISTRAL.hf.architecture(dataclasses.replace(MISTRAL_7B, sliding_window=4096))["sliding_window"] == 4096
    assert MISTRAL.hf.architecture(MISTRAL_7B)["sliding_window"] is None


# Rows of 20 tokens, a window of 6: every row is longer than the window.
WINDOW = 6
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))


def test_sliding_window_logits_and_round_trip_match_transformers(tmp_path):
    reference = random_hf_model("mistral", seed=1, sliding_window=WINDOW)
    reference.save_pretrained(tmp_path / "source")
    model = load_hf(tmp_path / "source").eval()
    assert model.args.sliding_window == WINDOW
    with torch.no_grad():
        expected = reference(TOKENS).logits
        torch.testing.assert_close(model(TOKENS), expected, atol=1e-5, rtol=0)
        assert (random_hf_model("mistral", seed=1)(TOKENS).logits - expected).abs().max() > 1e-3  # it slides

    save_hf(model, tmp_path / "saved")
    reloaded = MistralForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="eager").eval()
    assert reloaded.config.sliding_window == WINDOW
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS).logits, expected)


def test_every_ac_mode_gives_the_sliding_window_gradients_of_no_ac(tmp_path):
    random_hf_model("mistral", seed=3, sliding_window=WINDOW).save_pretrained(tmp_path)
    labels = torch.roll(TOKENS, -1, dims=1)
    gradients = {}
    for mode, keys in AC_MODES.items():
        model = from_hf_config(str(tmp_path), attn_dropout=0.1, resid_dropout=0.1)
        load_hf_weights_(model, tmp_path)
        setup_activation_checkpointing(model, **keys)
        torch.manual_seed(0)
        torch.nn.functional.cross_entropy(model.train()(TOKENS).flatten(0, 1), labels.flatten()).backward()
        gradients[mode] = {name: p.grad for name, p in model.named_parameters()}
    for mode, grads in gradients.items():
        for name, grad in grads.items():
            assert torch.equal(grad, gradients["none"][name]), (mode, name)


def test_transformers_reads_our_config_without_a_window(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL.hf.hf_config_from_args(MISTRAL_7B, torch.bfloat16)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "MistralConfig"
    assert hf.sliding_window is None
    assert (hf.head_dim, hf.num_key_value_heads, hf.rope_parameters["rope_theta"]) == (128, 8, 1_000_000.0)
