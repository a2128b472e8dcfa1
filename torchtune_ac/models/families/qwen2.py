"""The Qwen2 family (Qwen2.5): the Llama decoder with biases on the query, key and value projections.

The published Qwen2.5 checkpoints use full attention in every layer (``use_sliding_window: false``) and the
default RoPE; the small sizes tie their embeddings.
"""

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, Refusal, refuse_truthy, refuse_unless
from torchtune_ac.models.llama import LlamaArgs

_QWEN2_5 = dict(model_type="qwen2", norm_eps=1e-6, rope_theta=1_000_000.0, qkv_bias=True)
QWEN2_5_0_5B = LlamaArgs(vocab_size=151_936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_dim=4864,
                         max_seq_len=32_768, tie_embeddings=True, **_QWEN2_5)
QWEN2_5_1_5B = LlamaArgs(vocab_size=151_936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_dim=8960,
                         max_seq_len=131_072, tie_embeddings=True, **_QWEN2_5)
QWEN2_5_7B = LlamaArgs(vocab_size=152_064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_dim=18_944,
                       max_seq_len=131_072, tie_embeddings=False, **_QWEN2_5)


def _full_attention_only(layer_types: object) -> str | None:
    if layer_types is None or (isinstance(layer_types, list) and set(layer_types) <= {"full_attention"}):
        return None
    return "only full attention in every layer is supported"


FAMILY = decoder_family(
    __name__,
    "qwen2",
    LlamaStyleHFAdapter(
        model_type="qwen2",
        architecture_name="Qwen2ForCausalLM",
        variant={"qkv_bias": True},
        refusals=(
            Refusal("use_sliding_window", refuse_truthy("sliding-window attention is not supported")),
            Refusal("layer_types", _full_attention_only),
            Refusal("use_mrope", refuse_unless((None, False), "multimodal RoPE (Qwen2-VL) is not supported")),
        ),
        # transformers' Qwen2Config then builds full attention in every layer, as ours.
        extra_config={"use_sliding_window": False, "sliding_window": None},
    ),
    {
        "qwen2_5_0_5b": (QWEN2_5_0_5B, "Qwen2.5 0.5B (494,032,768 parameters, tied embeddings)."),
        "qwen2_5_1_5b": (QWEN2_5_1_5B, "Qwen2.5 1.5B (1,543,714,304 parameters, tied embeddings)."),
        "qwen2_5_7b": (QWEN2_5_7B, "Qwen2.5 7B (7,615,616,512 parameters)."),
    },
    torchtune_builders={
        "torchtune.models.qwen2_5.qwen2_5_0_5b": TorchtuneBuilder("qwen2_5_0_5b"),
        # Base and instruct checkpoints of a size share one architecture.
        "torchtune.models.qwen2_5.qwen2_5_1_5b_base": TorchtuneBuilder("qwen2_5_1_5b"),
        "torchtune.models.qwen2_5.qwen2_5_1_5b_instruct": TorchtuneBuilder("qwen2_5_1_5b"),
        "torchtune.models.qwen2_5.qwen2_5_7b_base": TorchtuneBuilder("qwen2_5_7b"),
        "torchtune.models.qwen2_5.qwen2_5_7b_instruct": TorchtuneBuilder("qwen2_5_7b"),
    },
    torchtune_packages=("torchtune.models.qwen2", "torchtune.models.qwen2_5"),
)
# The builders are names of this module too (``torchtune_ac.models.families.qwen2.qwen2_5_7b``).
globals().update(FAMILY.builders)
