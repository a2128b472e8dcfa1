"""The Phi-3 family (Phi-3, Phi-3.5, Phi-4): builders (published shapes, exact parameter counts), config.json
translation (LongRoPE under its three names, partial rotary embeddings, the sliding window), the stacked q/k/v and
gate/up tensors of its checkpoints, and LongRoPE's short and long factors and packed documents against transformers.
Logits, round trip and AC against transformers' Phi3ForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``
(its tiny model has every variant); 2 processes against 1 in ``tests/integration/test_distributed.py``; tensor
parallelism in ``tests/integration/test_tensor_parallel_runs.py``."""

import dataclasses
import inspect
import json
import math

import pytest
import torch
from hf_families import TINY_SHAPE, random_hf_model, write_hf_checkpoint
from numerics import assert_close, llama_terms
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

import torchtune_ac.models.families.phi3 as phi3
from torchtune_ac.errors import UserError
from torchtune_ac.models import (
    PHI3,
    LongRopeScaling,
    family_for_hf_config,
    family_of,
    load_hf,
    save_hf,
    save_hf_state_dict,
)

PARAMETER_COUNTS = {"phi3_mini": 3_821_079_552, "phi4_14b": 14_659_507_200}
_COMMON = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
           "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "hidden_act": "silu",
           "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
_MINI = {"hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
         "num_key_value_heads": 32, "vocab_size": 32064, "rope_theta": 10000.0}
# The config.json files published with the models (the keys that matter; LongRoPE's 48 factors made up).
SHORT, LONG = [1.0 + i / 100 for i in range(48)], [1.0 + i for i in range(48)]
PUBLISHED = {
    "Phi-3-mini-4k-instruct": {**_COMMON, **_MINI, "max_position_embeddings": 4096,
                               "original_max_position_embeddings": 4096, "rope_scaling": None,
                               "sliding_window": 2047},
    "phi-4": {**_COMMON, "hidden_size": 5120, "intermediate_size": 17920, "num_attention_heads": 40,
              "num_hidden_layers": 40, "num_key_value_heads": 10, "vocab_size": 100352, "rope_theta": 250000,
              "max_position_embeddings": 16384, "original_max_position_embeddings": 16384, "rope_scaling": None,
              "sliding_window": None},
    # The 128k models: LongRoPE, original length at the top level.
    "Phi-3-mini-128k-instruct": {**_COMMON, **_MINI, "max_position_embeddings": 131072,
                                 "original_max_position_embeddings": 4096, "sliding_window": 262144,
                                 "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}},
    "Phi-4-mini-instruct": {**_COMMON, "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 24,
                            "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 200064,
                            "rope_theta": 10000.0, "max_position_embeddings": 131072,
                            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
                            "tie_word_embeddings": True, "sliding_window": 262144,
                            "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}},
}


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(phi3, name)()
    assert family_of(model) is PHI3
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_builders_share_the_builder_signature_and_pass_its_arguments(name):
    assert list(inspect.signature(getattr(phi3, name)).parameters) == ["attn_dropout", "resid_dropout", "max_seq_len"]
    with torch.device("meta"):
        model = getattr(phi3, name)(resid_dropout=0.1, max_seq_len=2048)
    assert model.args == dataclasses.replace(getattr(phi3, name.upper()), resid_dropout=0.1, max_seq_len=2048)


def test_published_configs_translate_to_the_builders_and_the_128k_variants():
    assert family_for_hf_config(PUBLISHED["phi-4"]) is PHI3
    assert PHI3.hf.args_from_hf_config(PUBLISHED["Phi-3-mini-4k-instruct"]) == phi3.PHI3_MINI
    assert PHI3.hf.args_from_hf_config(PUBLISHED["phi-4"]) == phi3.PHI4_14B
    # LongRoPE's attention factor from the length it extends by (131,072 / 4,096), as transformers derives it.
    expected = LongRopeScaling(tuple(SHORT), tuple(LONG), 4096, 131072, math.sqrt(1 + math.log(32) / math.log(4096)))
    mini_128k = PHI3.hf.args_from_hf_config(PUBLISHED["Phi-3-mini-128k-instruct"])
    assert mini_128k == dataclasses.replace(phi3.PHI3_MINI, max_seq_len=131072, sliding_window=262144,
                                            rope_scaling=expected)
    # Its first config.json named LongRoPE "su" (transformers 5.23's AutoConfig no longer loads that form).
    first = {**PUBLISHED["Phi-3-mini-128k-instruct"], "rope_scaling": {"type": "su", "short_factor": SHORT,
                                                                       "long_factor": LONG}}
    assert PHI3.hf.args_from_hf_config(first) == mini_128k
    phi4_mini = PHI3.hf.args_from_hf_config(PUBLISHED["Phi-4-mini-instruct"])
    assert (phi4_mini.rope_scaling, phi4_mini.partial_rotary_factor, phi4_mini.rotary_dim) == (expected, 0.75, 96)
    assert phi4_mini.tie_embeddings and phi4_mini.n_kv_heads == 8


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_transformers_5_configs_translate_alike_and_transformers_reads_ours_back(name, tmp_path):
    """transformers 5 writes ``rope_parameters`` (with partial_rotary_factor) and every default; what we write it
    reads as the same model: same RoPE, window and shapes."""
    published = PUBLISHED[name]
    args = PHI3.hf.args_from_hf_config(published)
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert PHI3.hf.args_from_hf_config(AutoConfig.from_pretrained(tmp_path).to_dict()) == args
    (tmp_path / "config.json").write_text(json.dumps(PHI3.hf.hf_config_from_args(args, torch.bfloat16)))
    ours = AutoConfig.from_pretrained(tmp_path)
    assert type(ours).__name__ == "Phi3Config"
    assert PHI3.hf.args_from_hf_config(ours.to_dict()) == args
    assert ours.sliding_window == args.sliding_window
    assert ours.max_position_embeddings == published["max_position_embeddings"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic': only 'longrope' or "
                                                               "'default' RoPE is supported"),
        ({"rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG[:3]}},
         "rope_scaling.long_factor has 3 entries, must have one per rotated pair (48)"),
        ({"rope_scaling": {"type": "longrope", "short_factor": "1.0", "long_factor": LONG}},
         "rope_scaling.short_factor='1.0': must be a list of numbers"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5 must be in (0, 1]"),
        ({"sliding_window": "2047"}, "sliding_window='2047': must be int"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu': only 'silu' is supported"),
    ],
)
def test_unsupported_phi3_configs_are_refused_in_one_line_naming_the_key(change, message):
    with pytest.raises(UserError, match="phi3 config") as info:
        PHI3.hf.args_from_hf_config({**PUBLISHED["Phi-3-mini-4k-instruct"], **change})
    assert message in str(info.value) and "\n" not in str(info.value)


# ---- stacked tensors -----------------------------------------------------------------------------------------


def test_checkpoints_hold_q_k_v_and_gate_up_stacked_in_transformers_order(tmp_path):
    write_hf_checkpoint("phi3", tmp_path / "source", seed=4)
    model = load_hf(tmp_path / "source")
    save_hf(model, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert not any(part in name for name in saved for part in (".q_proj.", ".k_proj.", ".gate_proj.", ".up_proj."))
    attn, mlp = model.layers[1].attn, model.layers[1].mlp
    # Bit for bit: the same values copied, in the source's layout (query heads, key heads, value heads; gate, up).
    assert torch.equal(saved["model.layers.1.self_attn.qkv_proj.weight"],
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(saved["model.layers.1.mlp.gate_up_proj.weight"],
                       torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    source = load_file(tmp_path / "source" / "model.safetensors")
    assert saved.keys() == source.keys() and all(torch.equal(saved[k], source[k]) for k in saved)
    save_hf_state_dict(model.state_dict(), model.args, tmp_path / "from_state_dict", family="phi3")
    from_state_dict = load_file(tmp_path / "from_state_dict" / "model.safetensors")
    assert from_state_dict.keys() == saved.keys() and all(torch.equal(from_state_dict[k], saved[k]) for k in saved)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(24, 32)}),
     "model.safetensors: model.layers.0.self_attn.qkv_proj.weight has shape [24, 32], expected [64, 32]"),
    (lambda t: t.pop("model.layers.1.mlp.gate_up_proj.weight"),
     "missing tensor model.layers.1.mlp.gate_up_proj.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)}),
     "model.safetensors: unexpected tensor model.layers.0.self_attn.q_proj.weight"),
])
def test_a_bad_stacked_tensor_is_refused_once_naming_it(tmp_path, edit, message):
    write_hf_checkpoint("phi3", tmp_path, seed=4)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as info:
        load_hf(tmp_path)
    assert str(info.value).count(message) == 1, str(info.value)


# ---- LongRoPE, the window and packed documents against transformers ------------------------------------------

GENERATOR = torch.Generator().manual_seed(1)
ROWS_20 = torch.randint(0, 96, (2, 20), generator=GENERATOR)  # past the original length (16): long factors
ROWS_12 = torch.randint(0, 96, (2, 12), generator=GENERATOR)  # within it: short factors


@pytest.mark.numerics
def test_short_factors_within_the_original_length_and_packed_documents_match_transformers(tmp_path):
    reference = random_hf_model("phi3", seed=6)
    reference.save_pretrained(tmp_path)
    model = load_hf(tmp_path).eval()
    terms = llama_terms(model.args, 20, 0, backward=False)
    with torch.no_grad():
        assert_close(model(ROWS_12), reference(ROWS_12).logits, terms=terms, what="logits, short factors")
        # Two documents of 12 and 8 tokens packed in a row of 20: each as transformers computes it alone (its
        # positions, hence its factors, are its own: the short ones, where the whole row would take the long).
        packed = torch.cat([ROWS_12, ROWS_20[:, :8]], dim=1)
        document_ids = torch.tensor([0] * 12 + [1] * 8).expand(2, 20)
        expected = torch.cat([reference(ROWS_12).logits, reference(ROWS_20[:, :8]).logits], dim=1)
        assert_close(model(packed, document_ids=document_ids), expected, terms=terms, what="packed logits")
        assert (model(packed) - expected).abs().max() > 1e-3  # unpacked, the second document sees the first


def test_the_window_the_long_factors_and_the_attention_factor_matter(tmp_path):
    """The parity tests can fail: the same weights without the window, without LongRoPE, with its short factors or
    without its attention factor give other logits on rows past the original length and the window."""
    reference = random_hf_model("phi3", seed=6)
    reference.save_pretrained(tmp_path)
    model = load_hf(tmp_path).eval()
    scaling = model.args.rope_scaling
    with torch.no_grad():
        expected = reference(ROWS_20).logits
        for change in ({"sliding_window": None}, {"rope_scaling": None},
                       {"rope_scaling": dataclasses.replace(scaling, long_factor=scaling.short_factor)},
                       {"rope_scaling": dataclasses.replace(scaling, attention_factor=1.0)}):
            changed = PHI3.build(dataclasses.replace(model.args, **change)).eval()
            changed.load_state_dict(model.state_dict())
            assert (changed(ROWS_20) - expected).abs().max() > 1e-3, change
