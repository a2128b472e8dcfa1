"""The Qwen3 family (dense): the Llama decoder with q/k norms (an RMSNorm over head_dim, per head, before RoPE)
and a head_dim of 128 whatever the hidden size and head count.

Every published size has a 151,936-token vocabulary, no q/k/v biases, RoPE base 1e6 without scaling, RMSNorm
eps 1e-6, SwiGLU and full attention in every layer (``use_sliding_window: false``), and 40,960 positions (32,768
for the -Base checkpoints: ``max_seq_len`` is a run-time setting, the weights are the same). The 0.6B, 1.7B and
4B models tie their embeddings; a tied checkpoint that still stores ``lm_head.weight`` loads when that tensor
equals the embedding.
"""

from typing import Any, Mapping

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, Refusal, refuse_truthy
from torchtune_ac.models.llama import LlamaArgs

_HEAD_DIM = 128


def _qwen3(dim: int, intermediate_dim: int, n_layers: int, n_heads: int, tied: bool) -> LlamaArgs:
    return LlamaArgs(
        vocab_size=151_936, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8,
        intermediate_dim=intermediate_dim, max_seq_len=40_960, norm_eps=1e-6, rope_theta=1_000_000.0,
        tie_embeddings=tied, model_type="qwen3", qk_norm=True,
        # None where it is dim // n_heads: arguments read from config.json compare equal.
        head_dim=None if dim == n_heads * _HEAD_DIM else _HEAD_DIM,
    )


QWEN3_0_6B = _qwen3(1024, 3072, 28, 16, tied=True)
QWEN3_1_7B = _qwen3(2048, 6144, 28, 16, tied=True)
QWEN3_4B = _qwen3(2560, 9728, 36, 32, tied=True)
QWEN3_8B = _qwen3(4096, 12_288, 36, 32, tied=False)
QWEN3_14B = _qwen3(5120, 17_408, 40, 40, tied=False)
QWEN3_32B = _qwen3(5120, 25_600, 64, 64, tied=False)


class Qwen3HFAdapter(LlamaStyleHFAdapter):
    """Qwen3's config.json: ``head_dim`` defaults to 128 (transformers' ``Qwen3Config``), not hidden / heads."""

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        return {} if "head_dim" in config else {"head_dim": _HEAD_DIM}


def _full_attention_only(layer_types: object) -> str | None:
    if layer_types is None or (isinstance(layer_types, list) and set(layer_types) <= {"full_attention"}):
        return None
    return "only full attention in every layer is supported (the published Qwen3 models)"


FAMILY = decoder_family(
    __name__,
    "qwen3",
    Qwen3HFAdapter(
        model_type="qwen3",
        architecture_name="Qwen3ForCausalLM",
        variant={"qk_norm": True},
        refusals=(
            Refusal("use_sliding_window", refuse_truthy("sliding-window attention is not supported for Qwen3")),
            Refusal("layer_types", _full_attention_only),
        ),
        # transformers' Qwen3Config then builds full attention in every layer, as ours.
        extra_config={"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    ),
    {
        "qwen3_0_6b": (QWEN3_0_6B, "Qwen3 0.6B (596,049,920 parameters, tied embeddings)."),
        "qwen3_1_7b": (QWEN3_1_7B, "Qwen3 1.7B (1,720,574,976 parameters, tied embeddings)."),
        "qwen3_4b": (QWEN3_4B, "Qwen3 4B (4,022,468,096 parameters, tied embeddings)."),
        "qwen3_8b": (QWEN3_8B, "Qwen3 8B (8,190,735,360 parameters)."),
        "qwen3_14b": (QWEN3_14B, "Qwen3 14B (14,768,307,200 parameters)."),
        "qwen3_32b": (QWEN3_32B, "Qwen3 32B (32,762,123,264 parameters)."),
    },
    torchtune_builders={
        # Base and instruct checkpoints of a size share one architecture (the base ones have 32,768 positions).
        **{f"torchtune.models.qwen3.qwen3_{size}_{kind}": TorchtuneBuilder(f"qwen3_{size}")
           for size in ("0_6b", "1_7b", "4b", "8b", "14b") for kind in ("base", "instruct")},
        "torchtune.models.qwen3.qwen3_32b": TorchtuneBuilder("qwen3_32b"),
    },
    torchtune_packages=("torchtune.models.qwen3",),
)
# The builders are names of this module too (``torchtune_ac.models.families.qwen3.qwen3_8b``).
globals().update(FAMILY.builders)
