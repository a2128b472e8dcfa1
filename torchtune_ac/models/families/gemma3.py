"""The Gemma 3 family (text): the Llama decoder with Gemma's flags and a block of its own.

What is a flag (``LlamaArgs``): ``(1 + w)`` RMSNorms computed in float32, embeddings scaled by sqrt(hidden_size)
(rounded to the weight dtype), GeGLU (``gelu_pytorch_tanh``), q/k norms before RoPE, the attention scale
``query_pre_attn_scalar ** -0.5``, tied embeddings, and the attention pattern: layer i is global when
(i + 1) % 6 == 0 and slides otherwise, global layers with RoPE base 1e6 (linearly scaled by 8 on 4B, 12B and
27B), local ones with base 1e4 and no scaling. What is structure (``Gemma3Block``, here): four norms per block,
the attention's and the MLP's outputs normed before they join the residual.

Checkpoints: the 1B model is ``model_type: gemma3_text``; 4B, 12B and 27B are the text towers of multimodal
checkpoints (``model_type: gemma3``, a ``text_config``), whose text weights sit under ``language_model.model.``
in Google's files and under ``model.language_model.`` once transformers 5 saves them: both load, the vision tower
is left out. A model is always saved as a text-only ``gemma3_text`` checkpoint (``Gemma3ForCausalLM``), which
transformers and vLLM load. Missing config.json keys take transformers' ``Gemma3TextConfig`` defaults, as the
published multimodal configs rely on.
"""

from typing import Any, Mapping, Optional

import torch

from torchtune_ac.models.attention import DocumentRuns
from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LLAMA_BLOCK_NAMES, LlamaStyleHFAdapter, Refusal, read_value, refuse_truthy
from torchtune_ac.models.llama import LinearRopeScaling, LlamaArgs, RMSNorm, TransformerBlock
from torchtune_ac.models.tensor_parallel import Split

_GLOBAL_EVERY = 6  # transformers' sliding_window_pattern


def _layer_types(n_layers: int, pattern: int = _GLOBAL_EVERY) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers))


def _gemma3(vocab_size: int, dim: int, intermediate_dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
            head_dim: int, window: int, max_seq_len: int, query_pre_attn_scalar: int,
            scaling: Optional[LinearRopeScaling]) -> LlamaArgs:
    return LlamaArgs(
        vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        intermediate_dim=intermediate_dim, max_seq_len=max_seq_len, norm_eps=1e-6, rope_theta=1_000_000.0,
        rope_scaling=scaling, tie_embeddings=True, head_dim=None if dim == n_heads * head_dim else head_dim,
        model_type="gemma3_text", qk_norm=True, norm_offset=1.0, scale_embeddings=True,
        activation="gelu_pytorch_tanh", query_pre_attn_scalar=query_pre_attn_scalar, sliding_window=window,
        layer_types=_layer_types(n_layers), sliding_rope_theta=10_000.0,
    )


_SCALED = LinearRopeScaling(8.0)
GEMMA3_1B = _gemma3(262_144, 1152, 6912, 26, 4, 1, 256, 512, 32_768, 256, None)
GEMMA3_4B = _gemma3(262_208, 2560, 10_240, 34, 8, 4, 256, 1024, 131_072, 256, _SCALED)
GEMMA3_12B = _gemma3(262_208, 3840, 15_360, 48, 16, 8, 256, 1024, 131_072, 256, _SCALED)
GEMMA3_27B = _gemma3(262_208, 5376, 21_504, 62, 32, 16, 128, 1024, 131_072, 168, _SCALED)


class Gemma3Block(TransformerBlock):
    """Gemma 3's block: ``h = x + drop(post_attn_norm(attn(attn_norm(x))))``;
    ``out = h + drop(post_mlp_norm(mlp(mlp_norm(h))))``."""

    def __init__(self, args: LlamaArgs, window: Optional[int] = None, layer: int = 0) -> None:
        super().__init__(args, window, layer)
        self.post_attn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.post_mlp_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, runs: Optional[DocumentRuns] = None
    ) -> torch.Tensor:
        h = x + self.resid_dropout(self.post_attn_norm(self.attn(self.attn_norm(x), cos, sin, runs)))
        return h + self.resid_dropout(self.post_mlp_norm(self.mlp(self.mlp_norm(h))))


# transformers' Gemma3TextConfig defaults, for the keys a published config.json may leave out.
_TEXT_DEFAULTS = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}
# The key ``_text_config`` keeps the sliding layers' RoPE type under (transformers 5's form), to check it.
_LOCAL_ROPE_TYPE = "rope_parameters.sliding_attention.rope_type"
# Where the text tower's tensors are in a multimodal checkpoint: Google's files, and transformers 5's.
_TOWER_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                   ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))


class Gemma3HFAdapter(LlamaStyleHFAdapter):
    """Gemma 3's config.json (text-only or multimodal) and tensor names."""

    @property
    def model_types_read(self) -> tuple[str, ...]:
        return ("gemma3_text", "gemma3")

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> LlamaArgs:
        return super().args_from_hf_config(self._text_config(config), **overrides)

    def hf_config_from_args(self, args: LlamaArgs, dtype: Any, *, base_config: Optional[Mapping[str, Any]] = None,
                            **token_ids: Any) -> dict[str, Any]:
        # The checkpoint written is text-only (gemma3_text): of a multimodal base config, only the text tower's keys
        # are kept (not its vision tower or image tokens).
        if base_config is not None and base_config.get("model_type") == "gemma3" and isinstance(
                base_config.get("text_config"), Mapping):
            base_config = {"tie_word_embeddings": base_config.get("tie_word_embeddings", True),
                           **base_config["text_config"]}
        return super().hf_config_from_args(args, dtype, base_config=base_config, **token_ids)

    def _text_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The text model's config.json in the published (transformers 4) form: a multimodal checkpoint's
        ``text_config``, transformers' defaults for missing keys, and transformers 5's per-layer-type
        ``rope_parameters`` as ``rope_theta`` and ``rope_scaling`` (global layers) and ``rope_local_base_freq``
        (sliding ones)."""
        text = dict(config)
        if config.get("model_type") == "gemma3" and isinstance(config.get("text_config"), Mapping):
            text = {"tie_word_embeddings": config.get("tie_word_embeddings", True), **config["text_config"],
                    "model_type": "gemma3"}
        rope = text.get("rope_parameters")
        if isinstance(rope, Mapping) and {"full_attention", "sliding_attention"} & rope.keys():
            del text["rope_parameters"]
            full, sliding = dict(rope.get("full_attention") or {}), dict(rope.get("sliding_attention") or {})
            text["rope_theta"] = full.pop("rope_theta", _TEXT_DEFAULTS["rope_theta"])
            text["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
            text["rope_local_base_freq"] = sliding.get("rope_theta", _TEXT_DEFAULTS["rope_local_base_freq"])
            text[_LOCAL_ROPE_TYPE] = sliding.get("rope_type", "default")
        return {**_TEXT_DEFAULTS, **text}

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        local_rope_type = config.get(_LOCAL_ROPE_TYPE, "default")
        if local_rope_type != "default":
            problems.append(f"rope_parameters.sliding_attention.rope_type={local_rope_type!r}: only the default "
                            "RoPE is supported on sliding-window layers")
        n_layers = config.get("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None and isinstance(n_layers, int):
            pattern = read_value(config, "sliding_window_pattern", int, problems, default=_GLOBAL_EVERY)
            layer_types = _layer_types(n_layers, pattern or _GLOBAL_EVERY)
        elif not isinstance(layer_types, list):
            problems.append(f"layer_types={layer_types!r}: must be a list")
            layer_types = None
        return {
            "query_pre_attn_scalar": read_value(config, "query_pre_attn_scalar", int, problems),
            "sliding_window": read_value(config, "sliding_window", int, problems),
            "layer_types": None if layer_types is None else tuple(layer_types),
            "sliding_rope_theta": read_value(config, "rope_local_base_freq", float, problems),
        }

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        return {
            "query_pre_attn_scalar": args.query_pre_attn_scalar,
            "sliding_window": args.sliding_window,
            "layer_types": None if args.layer_types is None else list(args.layer_types),
            "rope_local_base_freq": args.sliding_rope_theta,
        }

    def stored_name(self, config: Mapping[str, Any], name: str) -> Optional[str]:
        if config.get("model_type") != "gemma3":
            return super().stored_name(config, name)
        for prefix, text_prefix in _TOWER_PREFIXES:
            if name.startswith(prefix):
                return text_prefix + name[len(prefix):]
        return None  # the vision tower and the projector of a multimodal checkpoint


FAMILY = decoder_family(
    __name__,
    "gemma3",
    Gemma3HFAdapter(
        model_type="gemma3_text",
        architecture_name="Gemma3ForCausalLM",
        variant={"qk_norm": True, "norm_offset": 1.0, "scale_embeddings": True, "activation": "gelu_pytorch_tanh"},
        refusals=(
            Refusal("final_logit_softcapping", refuse_truthy("logit soft-capping is not supported")),
            Refusal("attn_logit_softcapping", refuse_truthy("attention soft-capping is not supported")),
            Refusal("use_bidirectional_attention", refuse_truthy("bidirectional attention is not supported")),
        ),
        rope_types=("linear",),
        block_names=(*LLAMA_BLOCK_NAMES[:2], ("post_attn_norm.", "post_attention_layernorm."),
                     ("mlp_norm.", "pre_feedforward_layernorm."), ("post_mlp_norm.", "post_feedforward_layernorm."),
                     ("mlp.", "mlp.")),
        activation_key="hidden_activation",
        extra_config={"attention_bias": False, "final_logit_softcapping": None, "attn_logit_softcapping": None},
    ),
    {
        "gemma3_1b": (GEMMA3_1B, "Gemma 3 1B (999,885,952 parameters, tied embeddings)."),
        "gemma3_4b": (GEMMA3_4B, "Gemma 3 4B, the text tower (3,880,263,168 parameters, tied embeddings)."),
        "gemma3_12b": (GEMMA3_12B, "Gemma 3 12B, the text tower (11,766,034,176 parameters, tied embeddings)."),
        "gemma3_27b": (GEMMA3_27B, "Gemma 3 27B, the text tower (27,009,346,304 parameters, tied embeddings)."),
    },
    block=Gemma3Block,
    # The post-norms scale the attention's and the MLP's outputs after their rows are summed and scattered along
    # the sequence, before the residual add: on the sequence shard, as the pre-norms.
    block_splits={"post_attn_norm": Split.SEQUENCE, "post_mlp_norm": Split.SEQUENCE},
    torchtune_builders={
        # torchtune's unreleased builders; two have shapes no published checkpoint has.
        "torchtune.models.gemma3.gemma3_1b": TorchtuneBuilder("gemma3_1b"),
        "torchtune.models.gemma3.gemma3_4b": TorchtuneBuilder("gemma3_4b"),
        "torchtune.models.gemma3.gemma3_12b": TorchtuneBuilder(
            "gemma3_12b", "torchtune's gemma3_12b has 4 key/value heads; the published model, and ours, 8"),
        "torchtune.models.gemma3.gemma3_27b": TorchtuneBuilder(
            "gemma3_27b", "torchtune's gemma3_27b has head_dim 256; the published model, and ours, 128"),
    },
    torchtune_packages=("torchtune.models.gemma3",),
)
# The builders are names of this module too (``torchtune_ac.models.families.gemma3.gemma3_4b``).
globals().update(FAMILY.builders)
