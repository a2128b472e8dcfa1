"""The Llama family: builders (published shapes, exact parameter counts, signatures) and config.json translation."""

import dataclasses
import inspect
import json

import pytest
import torch
from transformers import AutoConfig

import torchtune_ac.models.families.llama as builders
from torchtune_ac.errors import UserError
from torchtune_ac.models import LLAMA, Llama, LlamaArgs, RopeScaling, llama_from_hf_config

llama_args_from_hf_config = LLAMA.hf.args_from_hf_config
hf_config_from_llama_args = LLAMA.hf.hf_config_from_args

# builder name -> exact parameter count (a tied weight counted once)
PARAMETER_COUNTS = {
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama3_1_8b": 8_030_261_248,
    "llama3_1_70b": 70_553_706_496,
    "llama3_2_1b": 1_235_814_400,
    "llama3_2_3b": 3_212_749_824,
    "llama_tiny": 1_607_808,
    "llama_small": 31_990_272,
    "llama_small_32k": 45_355_520,
}
BUILDERS = sorted(PARAMETER_COUNTS)

LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=8192)
LLAMA32_SCALING = dataclasses.replace(LLAMA31_SCALING, factor=32.0)

# The config.json files published with the models (the keys that matter).
PUBLISHED_CONFIGS = {
    "llama2_7b": {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 11008,
        "max_position_embeddings": 4096, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "vocab_size": 32000,
    },
    "llama3_8b": {
        "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "vocab_size": 128256,
        "tie_word_embeddings": False,
    },
    "llama3_2_1b": {
        "model_type": "llama", "attention_bias": False, "mlp_bias": False, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256,
    },
}


@pytest.mark.parametrize("name", BUILDERS)
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(builders, name)()
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", BUILDERS)
def test_builder_signature_is_explicit_keywords(name):
    signature = inspect.signature(getattr(builders, name))
    params = signature.parameters
    assert list(params) == ["attn_dropout", "resid_dropout", "max_seq_len"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
    assert [p.annotation for p in params.values()] == [float, float, int | None]
    assert [p.default for p in params.values()] == [0.0, 0.0, None]
    assert signature.return_annotation is Llama


@pytest.mark.parametrize("name", BUILDERS)
def test_builder_passes_dropout_and_max_seq_len(name):
    with torch.device("meta"):
        model = getattr(builders, name)(attn_dropout=0.1, resid_dropout=0.2, max_seq_len=256)
    expected = dataclasses.replace(getattr(builders, name.upper()), attn_dropout=0.1, resid_dropout=0.2,
                                   max_seq_len=256)
    assert model.args == expected


@pytest.mark.parametrize("name", BUILDERS)
def test_builder_defaults_are_the_published_args(name):
    with torch.device("meta"):
        assert getattr(builders, name)().args == getattr(builders, name.upper())


@pytest.mark.parametrize(
    "name, expected",
    [
        ("llama2_7b", dict(vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096, n_kv_heads=32)),
        ("llama3_8b", dict(vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, n_kv_heads=8, rope_scaling=None)),
        ("llama3_70b", dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_dim=28672)),
        ("llama3_1_8b", dict(rope_scaling=LLAMA31_SCALING, max_seq_len=131072, tie_embeddings=False)),
        ("llama3_1_70b", dict(rope_scaling=LLAMA31_SCALING, max_seq_len=131072, n_layers=80)),
        ("llama3_2_1b", dict(rope_scaling=LLAMA32_SCALING, tie_embeddings=True, resolved_head_dim=64)),
        ("llama3_2_3b", dict(rope_scaling=LLAMA32_SCALING, tie_embeddings=True, resolved_head_dim=128, n_heads=24)),
        ("llama_tiny", dict(vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, intermediate_dim=352,
                            max_seq_len=512, tie_embeddings=False)),
        ("llama_small", dict(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_dim=1408,
                             max_seq_len=2048, tie_embeddings=False)),
        ("llama_small_32k", dict(vocab_size=32768, dim=512, n_layers=4, intermediate_dim=1408, tie_embeddings=False)),
    ],
)
def test_published_shapes(name, expected):
    args = getattr(builders, name.upper())
    assert {key: getattr(args, key) for key in expected} == expected


@pytest.mark.parametrize("name", sorted(PUBLISHED_CONFIGS))
def test_published_config_json_translates_to_builder_args(name):
    assert llama_args_from_hf_config(PUBLISHED_CONFIGS[name]) == getattr(builders, name.upper())


def test_invalid_dropout_is_a_user_error():
    with pytest.raises(UserError, match="llama_tiny.*attn_dropout=1.5"):
        builders.llama_tiny(attn_dropout=1.5)


@pytest.mark.parametrize("name", BUILDERS)
def test_hf_config_round_trip(name):
    args = dataclasses.replace(getattr(builders, name.upper()), attn_dropout=0.1)
    config = hf_config_from_llama_args(args, torch.bfloat16)
    assert config["dtype"] == "bfloat16"
    assert llama_args_from_hf_config(config) == args


@pytest.mark.parametrize("name", ["llama2_7b", "llama3_1_8b", "llama3_2_3b"])
def test_transformers_reads_our_config(tmp_path, name):
    args = getattr(builders, name.upper())
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_llama_args(args, torch.float32)))

    config = AutoConfig.from_pretrained(tmp_path)

    scaling = args.rope_scaling
    expected_rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if scaling is not None:
        expected_rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, **dataclasses.asdict(scaling)}
    assert config.rope_parameters == expected_rope
    assert (config.head_dim, config.num_key_value_heads, config.tie_word_embeddings, config.rms_norm_eps) == (
        args.resolved_head_dim, args.n_kv_heads, args.tie_embeddings, args.norm_eps)


BASE_CONFIG = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 256,
}
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 64}
LEGACY_SCALING = {key: value for key, value in SCALING.items() if key != "rope_type"}


@pytest.mark.parametrize(
    "extra",
    [
        {"rope_theta": 500000.0, "rope_scaling": SCALING},  # transformers 4 / published form
        {"rope_parameters": {**SCALING, "rope_theta": 500000.0}},  # transformers 5 form
        {"rope_theta": 500000.0, "rope_scaling": {**LEGACY_SCALING, "type": "llama3"}},  # "type", not "rope_type"
    ],
    ids=["rope_scaling", "rope_parameters", "legacy_type_key"],
)
def test_both_rope_forms_are_read(extra):
    args = llama_args_from_hf_config({**BASE_CONFIG, **extra})
    assert args.rope_theta == 500000.0
    assert args.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 64)


def test_defaults_follow_transformers():
    args = llama_args_from_hf_config(BASE_CONFIG)
    assert (args.n_kv_heads, args.norm_eps, args.rope_theta, args.rope_scaling, args.tie_embeddings) == (
        4, 1e-6, 10000.0, None, False)


def test_scaling_without_original_length_uses_max_positions():
    rope = {key: value for key, value in SCALING.items() if key != "original_max_position_embeddings"}
    args = llama_args_from_hf_config({**BASE_CONFIG, "rope_scaling": rope})
    assert args.rope_scaling.original_max_position_embeddings == 256


@pytest.mark.parametrize(
    "change, key",
    [
        ({"model_type": "mistral"}, "model_type='mistral'"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_parameters.rope_type='linear'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor: missing"),
        ({"vocab_size": None}, "vocab_size: missing"),
        ({"hidden_size": "32"}, "hidden_size='32': must be int"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes': must be bool"),
        ({"num_key_value_heads": 3}, "n_heads=4 must be a multiple of n_kv_heads=3"),
        ({"head_dim": -8}, "head_dim=-8 must be positive"),
        ({"head_dim": 0}, "head_dim=0 must be positive"),
        ({"rope_theta": 0}, "rope_theta=0.0 must be positive"),
    ],
)
def test_unsupported_config_names_the_key(change, key):
    with pytest.raises(UserError) as info:
        llama_args_from_hf_config({**BASE_CONFIG, **change})
    assert key in str(info.value)


def test_all_problems_are_listed_at_once():
    with pytest.raises(UserError) as info:
        llama_args_from_hf_config({**BASE_CONFIG, "model_type": "gpt2", "mlp_bias": True, "hidden_act": "relu"})
    assert all(key in str(info.value) for key in ("model_type", "mlp_bias", "hidden_act"))


def test_llama_from_hf_config_accepts_dict_file_and_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE_CONFIG))
    expected = dataclasses.replace(llama_args_from_hf_config(BASE_CONFIG), attn_dropout=0.1, resid_dropout=0.2)

    for source in (BASE_CONFIG, tmp_path / "config.json", str(tmp_path)):
        model = llama_from_hf_config(source, attn_dropout=0.1, resid_dropout=0.2)
        assert isinstance(model, Llama)
        assert model.args == expected


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), ('{"model_type": "llama",', "line 1"), ('{"model_type": "bert"}', "model_type")],
)
def test_llama_from_hf_config_errors_name_the_file(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    source = path if content is not None else tmp_path / "absent"
    with pytest.raises(UserError, match=message) as info:
        llama_from_hf_config(source)
    assert str(source) in str(info.value)


def test_head_dim_equal_to_default_is_normalised():
    args = llama_args_from_hf_config({**BASE_CONFIG, "head_dim": 8})
    assert args == LlamaArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, intermediate_dim=48,
                             max_seq_len=256, norm_eps=1e-6)
    assert llama_args_from_hf_config({**BASE_CONFIG, "head_dim": 16}).head_dim == 16
