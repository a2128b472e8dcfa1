"""The Qwen2 family (Qwen2.5): the Llama decoder with biases on the query, key and value projections.

The published Qwen2.5 checkpoints use full attention in every layer (``use_sliding_window: false``) and the
default RoPE; the small sizes tie their embeddings. Builders have the same keyword-only signature as every
builder (``attn_dropout``, ``resid_dropout``, ``max_seq_len``).
"""

from torchtune_ac.component_marker import config_component
from torchtune_ac.models.families.common import build_published, llama_style_family
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, Refusal, refuse_truthy, refuse_unless
from torchtune_ac.models.llama import Llama, LlamaArgs


class Qwen2(Llama):
    """A Qwen2 / Qwen2.5 model: ``Llama`` built with ``qkv_bias=True`` (a class of its own so that generic code
    finds its family, and with it the Hugging Face ``qwen2`` layout)."""

    def __init__(self, args: LlamaArgs) -> None:
        if not args.qkv_bias:
            raise ValueError("Qwen2 models have q/k/v projection biases: build them with qkv_bias=True")
        super().__init__(args)


_QWEN2_5 = dict(norm_eps=1e-6, rope_theta=1_000_000.0, qkv_bias=True)
QWEN2_5_0_5B = LlamaArgs(vocab_size=151_936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_dim=4864,
                         max_seq_len=32_768, tie_embeddings=True, **_QWEN2_5)
QWEN2_5_1_5B = LlamaArgs(vocab_size=151_936, dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, intermediate_dim=8960,
                         max_seq_len=131_072, tie_embeddings=True, **_QWEN2_5)
QWEN2_5_7B = LlamaArgs(vocab_size=152_064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_dim=18_944,
                       max_seq_len=131_072, tie_embeddings=False, **_QWEN2_5)


def _build(name: str, base: LlamaArgs, attn_dropout: float, resid_dropout: float, max_seq_len: int | None) -> Qwen2:
    return build_published(Qwen2, name, base, attn_dropout=attn_dropout, resid_dropout=resid_dropout,
                           max_seq_len=max_seq_len)


@config_component
def qwen2_5_0_5b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Qwen2:
    """Qwen2.5 0.5B (494,032,768 parameters, tied embeddings)."""
    return _build("qwen2_5_0_5b", QWEN2_5_0_5B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def qwen2_5_1_5b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Qwen2:
    """Qwen2.5 1.5B (1,543,714,304 parameters, tied embeddings)."""
    return _build("qwen2_5_1_5b", QWEN2_5_1_5B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def qwen2_5_7b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Qwen2:
    """Qwen2.5 7B (7,615,616,512 parameters)."""
    return _build("qwen2_5_7b", QWEN2_5_7B, attn_dropout, resid_dropout, max_seq_len)


def _full_attention_only(layer_types: object) -> str | None:
    if layer_types is None or (isinstance(layer_types, list) and set(layer_types) <= {"full_attention"}):
        return None
    return "only full attention in every layer is supported"


QWEN2 = llama_style_family(
    "qwen2",
    Qwen2,
    {builder.__name__: builder for builder in (qwen2_5_0_5b, qwen2_5_1_5b, qwen2_5_7b)},
    LlamaStyleHFAdapter(
        model_type="qwen2",
        architecture_name="Qwen2ForCausalLM",
        qkv_bias=True,
        refusals=(
            Refusal("use_sliding_window", refuse_truthy("sliding-window attention is not supported")),
            Refusal("layer_types", _full_attention_only),
            Refusal("use_mrope", refuse_unless((None, False), "multimodal RoPE (Qwen2-VL) is not supported")),
        ),
        # transformers' Qwen2Config then builds full attention in every layer, as ours.
        extra_config={"use_sliding_window": False, "sliding_window": None},
    ),
)
