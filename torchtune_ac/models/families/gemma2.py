"""The Gemma 2 family: the Llama decoder with Gemma's flags, soft-capping, and Gemma 3's four-norm block.

What is a flag (``LlamaArgs``): ``(1 + w)`` RMSNorms computed in float32, embeddings scaled by sqrt(hidden_size)
(rounded to the weight dtype), GeGLU (``gelu_pytorch_tanh``), the attention scale ``query_pre_attn_scalar ** -0.5``,
tied embeddings, attention scores soft-capped at 50 (``attn_logit_softcapping``: ``50 * tanh(score / 50)``, on the
kernels ``models/attention.py`` names) and logits at 30 (``final_logit_softcapping``, in the chunked loss too), and
the attention pattern: layers alternate, a 4096-token sliding window on even layers (0, 2, ...), global attention
on odd ones, one RoPE (base 1e4) for both. What is structure: the block is Gemma 3's (``Gemma3Block``, which
Gemma 2 introduced): four norms, the attention's and the MLP's outputs normed before they join the residual.

Published config.json files (transformers 4.42) leave out ``tie_word_embeddings`` and ``layer_types``: missing keys
take transformers' ``Gemma2Config`` defaults. An explicit ``null`` soft-cap means no cap, as in transformers.
"""

from typing import Any, Mapping

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.families.gemma3 import Gemma3Block
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LLAMA_BLOCK_NAMES, LlamaStyleHFAdapter, Refusal, read_value, refuse_truthy
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.models.tensor_parallel import Split


def _layer_types(n_layers: int) -> tuple[str, ...]:
    # transformers' Gemma2Config: even layers slide, odd ones are global.
    return tuple("full_attention" if i % 2 else "sliding_attention" for i in range(n_layers))


def _gemma2(dim: int, intermediate_dim: int, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int,
            query_pre_attn_scalar: int) -> LlamaArgs:
    return LlamaArgs(
        vocab_size=256_000, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        intermediate_dim=intermediate_dim, max_seq_len=8192, norm_eps=1e-6, rope_theta=10_000.0, tie_embeddings=True,
        head_dim=None if dim == n_heads * head_dim else head_dim, model_type="gemma2", norm_offset=1.0,
        scale_embeddings=True, activation="gelu_pytorch_tanh", query_pre_attn_scalar=query_pre_attn_scalar,
        sliding_window=4096, layer_types=_layer_types(n_layers), attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    )


GEMMA2_2B = _gemma2(2304, 9216, 26, 8, 4, 256, 256)
GEMMA2_9B = _gemma2(3584, 14_336, 42, 16, 8, 256, 256)
GEMMA2_27B = _gemma2(4608, 36_864, 46, 32, 16, 128, 144)

# transformers' Gemma2Config defaults, for the keys a published config.json may leave out (not ``layer_types``,
# which follows from the layer count).
_DEFAULTS = {
    "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 10_000.0,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}


class Gemma2HFAdapter(LlamaStyleHFAdapter):
    """Gemma 2's config.json: transformers' defaults for missing keys, the alternating layers, the soft-caps."""

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> LlamaArgs:
        return super().args_from_hf_config({**_DEFAULTS, **config}, **overrides)

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        n_layers = config.get("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None and isinstance(n_layers, int):
            layer_types = _layer_types(n_layers)
        elif not isinstance(layer_types, list):
            problems.append(f"layer_types={layer_types!r}: must be a list")
            layer_types = None
        return {
            "query_pre_attn_scalar": read_value(config, "query_pre_attn_scalar", int, problems),
            "sliding_window": read_value(config, "sliding_window", int, problems),
            "layer_types": None if layer_types is None else tuple(layer_types),
            # null: no cap (transformers' reading); the published models cap both.
            "attn_logit_softcapping": read_value(config, "attn_logit_softcapping", float, problems, default=None),
            "final_logit_softcapping": read_value(config, "final_logit_softcapping", float, problems, default=None),
        }

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        return {
            "query_pre_attn_scalar": args.query_pre_attn_scalar,
            "sliding_window": args.sliding_window,
            "layer_types": None if args.layer_types is None else list(args.layer_types),
            "attn_logit_softcapping": args.attn_logit_softcapping,
            "final_logit_softcapping": args.final_logit_softcapping,
        }


_TORCHTUNE_CAPS = ("torchtune's gemma2 builders cap attention scores at 30 and logits at 50; the published model, and "
                   "ours, at 50 and 30")

FAMILY = decoder_family(
    __name__,
    "gemma2",
    Gemma2HFAdapter(
        model_type="gemma2",
        architecture_name="Gemma2ForCausalLM",
        variant={"norm_offset": 1.0, "scale_embeddings": True, "activation": "gelu_pytorch_tanh"},
        refusals=(
            Refusal("use_bidirectional_attention", refuse_truthy("bidirectional attention is not supported")),
        ),
        rope_types=(),
        block_names=(*LLAMA_BLOCK_NAMES[:2], ("post_attn_norm.", "post_attention_layernorm."),
                     ("mlp_norm.", "pre_feedforward_layernorm."), ("post_mlp_norm.", "post_feedforward_layernorm."),
                     ("mlp.", "mlp.")),
        activation_key="hidden_activation",
        extra_config={"attention_bias": False},
    ),
    {
        "gemma2_2b": (GEMMA2_2B, "Gemma 2 2B (2,614,341,888 parameters, tied embeddings)."),
        "gemma2_9b": (GEMMA2_9B, "Gemma 2 9B (9,241,705,984 parameters, tied embeddings)."),
        "gemma2_27b": (GEMMA2_27B, "Gemma 2 27B (27,227,128,320 parameters, tied embeddings)."),
    },
    block=Gemma3Block,
    # As Gemma 3's: the post-norms act on the sequence shard, as the pre-norms.
    block_splits={"post_attn_norm": Split.SEQUENCE, "post_mlp_norm": Split.SEQUENCE},
    torchtune_builders={
        "torchtune.models.gemma2.gemma2_2b": TorchtuneBuilder("gemma2_2b", _TORCHTUNE_CAPS),
        "torchtune.models.gemma2.gemma2_9b": TorchtuneBuilder("gemma2_9b", _TORCHTUNE_CAPS),
        "torchtune.models.gemma2.gemma2_27b": TorchtuneBuilder("gemma2_27b", _TORCHTUNE_CAPS),
    },
    torchtune_packages=("torchtune.models.gemma2",),
)
# The builders are names of this module too (``torchtune_ac.models.families.gemma2.gemma2_9b``).
globals().update(FAMILY.builders)
