"""The Gemma family (Gemma 1): the Llama decoder with Gemma's flags, and nothing else of its own.

``(1 + w)`` RMSNorms computed in float32, embeddings scaled by sqrt(hidden_size) (rounded to the weight dtype),
GeGLU (``gelu_pytorch_tanh``), head_dim 256 whatever the hidden size, tied embeddings, full attention. The
published config.json files say ``hidden_act: gelu`` and leave out ``tie_word_embeddings``: transformers reads
them as the tanh approximation and as tied, and so does this adapter.
"""

from typing import Any, Mapping

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter
from torchtune_ac.models.llama import LlamaArgs

_GEMMA = dict(vocab_size=256_000, max_seq_len=8192, norm_eps=1e-6, rope_theta=10_000.0, tie_embeddings=True,
              model_type="gemma", norm_offset=1.0, scale_embeddings=True, activation="gelu_pytorch_tanh")
# head_dim 256 is dim // n_heads for 2B (left as None, as config.json reads), not for 7B.
GEMMA_2B = LlamaArgs(dim=2048, n_layers=18, n_heads=8, n_kv_heads=1, intermediate_dim=16_384, **_GEMMA)
GEMMA_7B = LlamaArgs(dim=3072, n_layers=28, n_heads=16, n_kv_heads=16, intermediate_dim=24_576, head_dim=256,
                     **_GEMMA)

# transformers' GemmaConfig defaults for the keys the published config.json files leave out.
_DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256}


class GemmaHFAdapter(LlamaStyleHFAdapter):
    """Gemma's config.json: transformers' defaults for missing keys, and the legacy ``hidden_act: gelu`` read as the
    tanh approximation (transformers' ``GemmaConfig`` converts it)."""

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> LlamaArgs:
        config = {**_DEFAULTS, **config}
        if config.get("hidden_act") == "gelu":
            config["hidden_act"] = "gelu_pytorch_tanh"
        return super().args_from_hf_config(config, **overrides)


FAMILY = decoder_family(
    __name__,
    "gemma",
    GemmaHFAdapter(
        model_type="gemma",
        architecture_name="GemmaForCausalLM",
        variant={"norm_offset": 1.0, "scale_embeddings": True, "activation": "gelu_pytorch_tanh"},
        extra_config={"attention_bias": False},
    ),
    {
        "gemma_2b": (GEMMA_2B, "Gemma 2B (2,506,172,416 parameters, tied embeddings)."),
        "gemma_7b": (GEMMA_7B, "Gemma 7B (8,537,680,896 parameters, tied embeddings)."),
    },
    torchtune_builders={
        "torchtune.models.gemma.gemma_2b": TorchtuneBuilder("gemma_2b"),
        "torchtune.models.gemma.gemma_7b": TorchtuneBuilder("gemma_7b"),
    },
    torchtune_packages=("torchtune.models.gemma",),
)
# The builders are names of this module too (``torchtune_ac.models.families.gemma.gemma_7b``).
globals().update(FAMILY.builders)
