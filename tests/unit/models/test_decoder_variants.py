"""The decoder's variant flags (``LlamaArgs``): each computes what the transformers class of a family that has it
computes, on tiny random weights, and bad values are refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_oracle import dense_document_attention
from hf_families import randomize_
from transformers import GemmaConfig, GemmaForCausalLM, LlamaConfig, Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from torchtune_ac.errors import UserError
from torchtune_ac.models import LLAMA, LinearRopeScaling
from torchtune_ac.models.attention import causal_attention, document_runs
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter
from torchtune_ac.models.llama import Llama, LlamaArgs, RMSNorm, compute_rope_inv_freq

SHAPE = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=128,
             norm_eps=1e-6)
HF_SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64, max_position_embeddings=128, rms_norm_eps=1e-6)
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))

# name -> (transformers config and model class, config settings, the flags that give our decoder its architecture)
VARIANTS = {
    # Qwen3: q/k norms over head_dim (decoupled from dim / heads), before RoPE.
    "qk_norm": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=False),
                dict(qk_norm=True, head_dim=16)),
    # Gemma (1): (1 + w) norms in float32, embeddings scaled by sqrt(dim), GeGLU, head_dim 16, tied embeddings.
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(head_dim=16, hidden_act="gelu_pytorch_tanh"),
              dict(norm_offset=1.0, scale_embeddings=True, activation="gelu_pytorch_tanh", head_dim=16,
                   tie_embeddings=True)),
}


SHAPE_FLAGS = ("head_dim", "tie_embeddings")


def hf_and_ours(variant: str, dtype: torch.dtype) -> tuple[torch.nn.Module, Llama]:
    config_class, model_class, settings, flags = VARIANTS[variant]
    reference = model_class(config_class(**HF_SHAPE, **settings, attn_implementation="eager"))
    randomize_(reference, seed=1)
    ours = Llama(LlamaArgs(**SHAPE, **flags))
    hf_state = reference.state_dict()
    ours.load_state_dict({name: hf_state[LLAMA.hf.to_hf_name(name)] for name in ours.state_dict()})
    return reference.to(dtype).eval(), ours.to(dtype).eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_flags_give_the_logits_of_the_family_that_has_them(variant):
    reference, ours = hf_and_ours(variant, torch.float32)
    with torch.no_grad():
        expected = reference(TOKENS).logits
        torch.testing.assert_close(ours(TOKENS), expected, atol=1e-5, rtol=0)
        # The flags matter: without them, the same weights compute something else.
        flags = {k: LlamaArgs.__dataclass_fields__[k].default for k in VARIANTS[variant][3] if k not in SHAPE_FLAGS}
        plain = Llama(dataclasses.replace(ours.args, **flags)).eval()
        plain.load_state_dict(ours.state_dict(), strict=False)  # without the q/k norms
        assert (plain(TOKENS) - expected).abs().max() > 1e-2


def test_offset_norms_scale_in_float32_as_gemma_does():
    """In bf16 the order of the cast matters: Gemma multiplies by (1 + w) in float32, then casts."""
    reference, ours = hf_and_ours("gemma", torch.float32)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    hf_norm = reference.model.layers[0].input_layernorm.bfloat16()
    our_norm = ours.layers[0].attn_norm.bfloat16()
    assert torch.equal(our_norm(x), hf_norm(x))
    fresh = RMSNorm(32, 1e-6, offset=1.0)
    assert torch.equal(fresh.weight, torch.zeros(32))  # scales by 1 + 0
    torch.testing.assert_close(fresh(x.float()), RMSNorm(32, 1e-6)(x.float()))


def test_scaled_embeddings_use_sqrt_dim_rounded_to_the_weight_dtype():
    _, ours = hf_and_ours("gemma", torch.bfloat16)
    rounded = torch.tensor(32**0.5, dtype=torch.bfloat16)
    assert rounded.item() != 32**0.5
    hidden = {}
    ours.layers[0].register_forward_pre_hook(lambda module, args: hidden.update(h=args[0]))
    with torch.no_grad():
        ours(TOKENS)
    assert torch.equal(hidden["h"], ours.tok_embeddings(TOKENS) * rounded)


@pytest.mark.parametrize("packed", [False, True], ids=["one_sequence_per_row", "packed"])
def test_the_attention_scale_replaces_one_over_sqrt_head_dim(packed):
    ids = torch.tensor([[0] * 7 + [1] * 9, [0] * 16])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 16, 8, generator=generator) for heads in (4, 2, 2))
    runs = document_runs(ids) if packed else None
    oracle_ids = ids if packed else torch.zeros_like(ids)
    scaled = causal_attention(q, k, v, dropout_p=0.0, runs=runs, scale=24**-0.5)
    torch.testing.assert_close(scaled, dense_document_attention(q, k, v, oracle_ids, scale=24**-0.5))
    assert (scaled - causal_attention(q, k, v, dropout_p=0.0, runs=runs)).abs().max() > 1e-2
    model = Llama(LlamaArgs(**SHAPE, query_pre_attn_scalar=24))
    assert model.layers[0].attn.scale == 24**-0.5


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(activation="relu"), "activation='relu' must be one of silu, gelu_pytorch_tanh"),
        (dict(query_pre_attn_scalar=0), "query_pre_attn_scalar=0 must be positive"),
        (dict(sliding_window=0), "sliding_window=0 must be positive"),
        (dict(sliding_window=4, layer_types=("sliding_attention",)), "layer_types has 1 entries, must have one per"),
        (dict(sliding_window=4, layer_types=("full_attention", "local")), "layer_types: 'local' not one of"),
        (dict(layer_types=("sliding_attention", "full_attention")), "sliding_attention layers: set sliding_window"),
        (dict(sliding_rope_theta=10.0), "sliding_rope_theta is set but no layer slides"),
    ],
)
def test_bad_flags_are_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaArgs(**SHAPE, **change)


def test_each_layer_gets_the_window_its_type_says():
    every = LlamaArgs(**SHAPE, sliding_window=8)  # no layer_types: every layer slides (Mistral 7B v0.1)
    mixed = LlamaArgs(**SHAPE, sliding_window=8, layer_types=("full_attention", "sliding_attention"))
    assert [every.window_of(i) for i in range(2)] == [8, 8]
    assert [layer.attn.window for layer in Llama(mixed).layers] == [None, 8]
    assert [LlamaArgs(**SHAPE).window_of(i) for i in range(2)] == [None, None]


def test_qk_norm_adds_one_head_dim_weight_per_projection():
    model = Llama(LlamaArgs(**SHAPE, qk_norm=True, head_dim=16))
    norms = {name: tuple(p.shape) for name, p in model.named_parameters() if "_norm." in name and ".attn." in name}
    assert norms == {f"layers.{i}.attn.{p}_norm.weight": (16,) for i in range(2) for p in "qk"}


def test_linear_rope_scaling_divides_every_frequency_as_transformers_does():
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters={"rope_type": "linear", "factor": 8.0,
                                                                                "rope_theta": 10000.0})
    expected, _ = ROPE_INIT_FUNCTIONS["linear"](config, "cpu")
    assert torch.equal(compute_rope_inv_freq(32, 10000.0, LinearRopeScaling(8.0)), expected)


def test_linear_rope_scaling_is_read_and_written_by_a_family_that_has_it_only():
    linear = LlamaStyleHFAdapter(model_type="llama", architecture_name="LlamaForCausalLM", rope_types=("linear",))
    args = LlamaArgs(**SHAPE, rope_scaling=LinearRopeScaling(8.0))
    config = linear.hf_config_from_args(args, torch.float32)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert linear.args_from_hf_config(config) == args
    with pytest.raises(UserError, match="rope_scaling.rope_type='linear': only 'llama3' or 'default' RoPE"):
        LLAMA.hf.args_from_hf_config(config)
    with pytest.raises(ValueError, match="llama has llama3 RoPE scaling only"):
        LLAMA.hf.architecture(args)
