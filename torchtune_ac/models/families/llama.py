"""The Llama family: builders with the published Llama shapes, and two small CPU-sized models.

Every named builder has the same keyword-only signature (no ``**kwargs``: YAML configs instantiate builders by
dotted path, and the config system checks keys against the signature):

    attn_dropout:  dropout on attention probabilities (the published models use 0.0)
    resid_dropout: dropout on each residual branch (0.0)
    max_seq_len:   longest sequence the model is meant for; None keeps the published value

and raises ``UserError`` for an out-of-range value. Builders construct on the current default device: wrap a
call in ``with torch.device("meta"):`` to get shapes without allocating memory. The ``LlamaArgs`` constants
(``LLAMA3_8B``, ...) give the published arguments without building anything.
"""

import dataclasses

from torchtune_ac.component_marker import config_component
from torchtune_ac.models.families.common import build_published, llama_style_family
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter
from torchtune_ac.models.llama import Llama, LlamaArgs, RopeScaling

_LLAMA3_VOCAB = 128_256
_LLAMA3_THETA = 500_000.0
# Llama 3.1 and 3.2 stretch the original 8192-token RoPE to 131072 positions.
_LLAMA3_1_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                original_max_position_embeddings=8192)
_LLAMA3_2_SCALING = dataclasses.replace(_LLAMA3_1_SCALING, factor=32.0)

LLAMA2_7B = LlamaArgs(vocab_size=32_000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                      intermediate_dim=11_008, max_seq_len=4096, norm_eps=1e-5, rope_theta=10_000.0)
LLAMA3_8B = LlamaArgs(vocab_size=_LLAMA3_VOCAB, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      intermediate_dim=14_336, max_seq_len=8192, norm_eps=1e-5, rope_theta=_LLAMA3_THETA)
LLAMA3_70B = LlamaArgs(vocab_size=_LLAMA3_VOCAB, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       intermediate_dim=28_672, max_seq_len=8192, norm_eps=1e-5, rope_theta=_LLAMA3_THETA)
LLAMA3_1_8B = dataclasses.replace(LLAMA3_8B, max_seq_len=131_072, rope_scaling=_LLAMA3_1_SCALING)
LLAMA3_1_70B = dataclasses.replace(LLAMA3_70B, max_seq_len=131_072, rope_scaling=_LLAMA3_1_SCALING)
LLAMA3_2_1B = LlamaArgs(vocab_size=_LLAMA3_VOCAB, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                        intermediate_dim=8192, max_seq_len=131_072, norm_eps=1e-5, rope_theta=_LLAMA3_THETA,
                        rope_scaling=_LLAMA3_2_SCALING, tie_embeddings=True)
LLAMA3_2_3B = dataclasses.replace(LLAMA3_2_1B, dim=3072, n_layers=28, n_heads=24)
# vocab_size is fixed by the embedded tokenizer (torchtune_ac/data/embedded), which has exactly 512 tokens.
LLAMA_TINY = LlamaArgs(vocab_size=512, dim=128, n_layers=8, n_heads=4, n_kv_heads=2, intermediate_dim=352,
                       max_seq_len=512)
# About 32 M parameters: big enough for activation checkpointing to matter in CPU benchmarks.
LLAMA_SMALL = LlamaArgs(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_dim=1408,
                        max_seq_len=2048)
# About 45 M parameters with a 32,768-token vocabulary: the logits outweigh the rest, as for published models.
LLAMA_SMALL_32K = LlamaArgs(vocab_size=32_768, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, intermediate_dim=1408,
                            max_seq_len=2048)


def _build(name: str, base: LlamaArgs, attn_dropout: float, resid_dropout: float, max_seq_len: int | None) -> Llama:
    return build_published(Llama, name, base, attn_dropout=attn_dropout, resid_dropout=resid_dropout,
                           max_seq_len=max_seq_len)


@config_component
def llama2_7b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """Llama 2 7B (6,738,415,616 parameters)."""
    return _build("llama2_7b", LLAMA2_7B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama3_8b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """Llama 3 8B (8,030,261,248 parameters)."""
    return _build("llama3_8b", LLAMA3_8B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama3_70b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """Llama 3 70B (70,553,706,496 parameters)."""
    return _build("llama3_70b", LLAMA3_70B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama3_1_8b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """Llama 3.1 8B: Llama 3 8B shapes with scaled RoPE."""
    return _build("llama3_1_8b", LLAMA3_1_8B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama3_1_70b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0,
                 max_seq_len: int | None = None) -> Llama:
    """Llama 3.1 70B: Llama 3 70B shapes with scaled RoPE."""
    return _build("llama3_1_70b", LLAMA3_1_70B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama3_2_1b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """Llama 3.2 1B (1,235,814,400 parameters, tied embeddings)."""
    return _build("llama3_2_1b", LLAMA3_2_1B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama3_2_3b(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """Llama 3.2 3B (3,212,749,824 parameters, tied embeddings)."""
    return _build("llama3_2_3b", LLAMA3_2_3B, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama_tiny(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """The embedded default model (~1.6 M parameters)."""
    return _build("llama_tiny", LLAMA_TINY, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama_small_32k(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0,
                    max_seq_len: int | None = None) -> Llama:
    """The CPU memory-benchmark model: 4 blocks of ``llama_small`` with a 32,768-token vocabulary (~45 M
    parameters)."""
    return _build("llama_small_32k", LLAMA_SMALL_32K, attn_dropout, resid_dropout, max_seq_len)


@config_component
def llama_small(*, attn_dropout: float = 0.0, resid_dropout: float = 0.0, max_seq_len: int | None = None) -> Llama:
    """The CPU benchmark model (~32 M parameters)."""
    return _build("llama_small", LLAMA_SMALL, attn_dropout, resid_dropout, max_seq_len)


LLAMA = llama_style_family(
    "llama",
    Llama,
    {
        builder.__name__: builder
        for builder in (llama2_7b, llama3_8b, llama3_70b, llama3_1_8b, llama3_1_70b, llama3_2_1b, llama3_2_3b,
                        llama_tiny, llama_small, llama_small_32k)
    },
    LlamaStyleHFAdapter(
        model_type="llama",
        architecture_name="LlamaForCausalLM",
        extra_config={"attention_bias": False, "mlp_bias": False},
    ),
)
