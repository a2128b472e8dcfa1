"""The Gemma 3 family: builders (published shapes, exact parameter counts), config.json translation (text-only and
multimodal, transformers 4 and 5 forms), and the text tower of a multimodal checkpoint against transformers'
Gemma3ForConditionalGeneration, in both weight layouts, saved as a text-only checkpoint. Logits, round trip and AC
against transformers' Gemma3ForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``; 2 processes
against 1 in ``tests/integration/test_distributed.py``."""

import dataclasses
import inspect
import json

import pytest
import torch
from hf_families import GEMMA3_TINY, TINY_SHAPE, random_hf_model, randomize_
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

import torchtune_ac.models.families.gemma3 as gemma3
from torchtune_ac.errors import UserError
from torchtune_ac.models import GEMMA3, family_for_hf_config, family_of, load_hf, save_hf

PARAMETER_COUNTS = {"gemma3_1b": 999_885_952, "gemma3_4b": 3_880_263_168, "gemma3_12b": 11_766_034_176,
                    "gemma3_27b": 27_009_346_304}
# The config.json files published with the models (the keys that matter; the multimodal ones leave most of the
# text model's keys to transformers' defaults).
PUBLISHED_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144,
}
_SCALING = {"factor": 8.0, "rope_type": "linear"}
PUBLISHED_TEXT_CONFIGS = {
    "gemma3_4b": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                  "num_hidden_layers": 34, "rope_scaling": _SCALING, "sliding_window": 1024},
    "gemma3_12b": {"hidden_size": 3840, "intermediate_size": 15360, "model_type": "gemma3_text",
                   "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                   "rope_scaling": _SCALING, "sliding_window": 1024},
    "gemma3_27b": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                   "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                   "query_pre_attn_scalar": 168, "rope_scaling": _SCALING, "sliding_window": 1024},
}


def multimodal(text_config: dict) -> dict:
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 256,
            "image_token_index": 262144, "text_config": text_config,
            "vision_config": {"model_type": "siglip_vision_model"}}


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(gemma3, name)()
    assert family_of(model) is GEMMA3
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    assert isinstance(model.layers[0], gemma3.Gemma3Block)


def test_published_layers_alternate_five_local_then_one_global():
    args = gemma3.GEMMA3_4B
    assert [i for i, kind in enumerate(args.layer_types) if kind == "full_attention"] == [5, 11, 17, 23, 29]
    assert [args.window_of(i) for i in (4, 5)] == [1024, None]
    assert (args.rope_theta, args.rope_scaling, args.sliding_rope_theta) == (1e6, gemma3.LinearRopeScaling(8.0), 1e4)
    assert (gemma3.GEMMA3_1B.sliding_window, gemma3.GEMMA3_1B.rope_scaling) == (512, None)
    assert (gemma3.GEMMA3_27B.resolved_head_dim, gemma3.GEMMA3_27B.query_pre_attn_scalar) == (128, 168)


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_builders_share_the_builder_signature_and_pass_its_arguments(name):
    assert list(inspect.signature(getattr(gemma3, name)).parameters) == ["attn_dropout", "resid_dropout", "max_seq_len"]
    with torch.device("meta"):
        model = getattr(gemma3, name)(resid_dropout=0.1, max_seq_len=8192)
    assert model.args == dataclasses.replace(getattr(gemma3, name.upper()), resid_dropout=0.1, max_seq_len=8192)


def test_published_config_json_translates_to_builder_args():
    assert family_for_hf_config(PUBLISHED_1B) is GEMMA3
    assert GEMMA3.hf.args_from_hf_config(PUBLISHED_1B) == gemma3.GEMMA3_1B
    for name, text in PUBLISHED_TEXT_CONFIGS.items():
        assert family_for_hf_config(multimodal(text)) is GEMMA3
        assert GEMMA3.hf.args_from_hf_config(multimodal(text)) == getattr(gemma3, name.upper()), name


@pytest.mark.parametrize("name", sorted(PUBLISHED_TEXT_CONFIGS))
def test_transformers_5_configs_translate_alike(name):
    """transformers 5 writes per-layer-type ``rope_parameters`` and ``layer_types``, and every default."""
    text = Gemma3TextConfig(**PUBLISHED_TEXT_CONFIGS[name]).to_dict()
    assert "full_attention" in text["rope_parameters"]
    assert GEMMA3.hf.args_from_hf_config(text) == getattr(gemma3, name.upper())
    assert GEMMA3.hf.args_from_hf_config(multimodal(text)) == getattr(gemma3, name.upper())


def test_transformers_reads_our_config_as_gemma3_text(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3.hf.hf_config_from_args(gemma3.GEMMA3_4B, torch.bfloat16)))
    hf = AutoConfig.from_pretrained(tmp_path)
    assert type(hf).__name__ == "Gemma3TextConfig"
    assert hf.layer_types == list(gemma3.GEMMA3_4B.layer_types)
    assert hf.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert hf.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert (hf.sliding_window, hf.query_pre_attn_scalar, hf.head_dim, hf.vocab_size) == (1024, 256, 256, 262208)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0: logit soft-capping is not supported"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0: attention soft-capping is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True: bidirectional attention"),
        ({"hidden_activation": "gelu"}, "hidden_activation='gelu': only 'gelu_pytorch_tanh' is supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type='yarn'"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {
            "rope_type": "linear", "factor": 2.0}}}, "sliding_attention.rope_type='linear'"),
    ],
)
def test_unsupported_gemma3_configs_name_the_key(change, message):
    with pytest.raises(UserError, match="unsupported Hugging Face gemma3_text config") as info:
        GEMMA3.hf.args_from_hf_config({**PUBLISHED_1B, **change})
    assert message in str(info.value)


# ---- the text tower of a multimodal checkpoint -------------------------------------------------------------

TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))  # longer than the 6-token window


def random_multimodal(seed: int) -> Gemma3ForConditionalGeneration:
    config = Gemma3Config(
        text_config={**TINY_SHAPE, **GEMMA3_TINY},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 28, "patch_size": 14},
        mm_tokens_per_image=4, attn_implementation="eager",
    )
    model = Gemma3ForConditionalGeneration(config)
    randomize_(model, seed, norm_offset=1.0)
    return model.eval()


def to_transformers_5_names(checkpoint) -> None:
    """Rename Google's layout (what transformers 5.23 writes) to the one transformers 5 holds in memory."""
    weights = load_file(checkpoint / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in weights)
    renamed = {("model." + name if name.startswith(("vision_tower.", "multi_modal_projector.")) else
                name.replace("language_model.model.", "model.language_model.", 1)): t for name, t in weights.items()}
    save_file(renamed, checkpoint / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("layout", ["google", "transformers_5"])
def test_the_text_tower_of_a_multimodal_checkpoint_gives_its_logits_and_saves_as_gemma3_text(tmp_path, layout):
    reference = random_multimodal(seed=7)
    reference.save_pretrained(tmp_path / "multimodal")
    if layout == "transformers_5":
        to_transformers_5_names(tmp_path / "multimodal")

    model = load_hf(tmp_path / "multimodal").eval()
    assert family_of(model) is GEMMA3
    with torch.no_grad():
        expected = reference(input_ids=TOKENS).logits
        torch.testing.assert_close(model(TOKENS), expected, atol=1e-5, rtol=0)

    save_hf(model, tmp_path / "text")
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gemma3_text", ["Gemma3ForCausalLM"])
    assert not any("vision" in name for name in load_file(tmp_path / "text" / "model.safetensors"))
    reloaded = Gemma3ForCausalLM.from_pretrained(tmp_path / "text", attn_implementation="eager").eval()
    with torch.no_grad():
        # The same weights in transformers' text-only class compute the multimodal model's text logits exactly.
        assert torch.equal(reloaded(TOKENS).logits, expected)


def test_the_sliding_window_and_the_local_rope_matter_on_rows_longer_than_the_window(tmp_path):
    """The parity tests can fail: the same weights with full attention everywhere, or one RoPE, differ."""
    reference = random_hf_model("gemma3", seed=1)
    reference.save_pretrained(tmp_path)
    model = load_hf(tmp_path).eval()
    with torch.no_grad():
        expected = reference(TOKENS).logits
        full_attention = {"sliding_window": None, "layer_types": None, "sliding_rope_theta": None}
        for change in (full_attention, {"sliding_rope_theta": None}):
            changed = GEMMA3.build(dataclasses.replace(model.args, **change)).eval()
            changed.load_state_dict(model.state_dict())
            assert (changed(TOKENS) - expected).abs().max() > 1e-3, change
