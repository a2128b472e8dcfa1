"""The Llama family: builders with the published Llama shapes, and small CPU-sized models.

Builders share one signature (see ``models/decoder_family.py``). The ``LlamaArgs`` constants (``LLAMA3_8B``,
...) give the published arguments without building anything.
"""

import dataclasses

from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter
from torchtune_ac.models.llama import LlamaArgs, RopeScaling

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


FAMILY = decoder_family(
    __name__,
    "llama",
    LlamaStyleHFAdapter(
        model_type="llama",
        architecture_name="LlamaForCausalLM",
        extra_config={"attention_bias": False, "mlp_bias": False},
    ),
    {
        "llama2_7b": (LLAMA2_7B, "Llama 2 7B (6,738,415,616 parameters)."),
        "llama3_8b": (LLAMA3_8B, "Llama 3 8B (8,030,261,248 parameters)."),
        "llama3_70b": (LLAMA3_70B, "Llama 3 70B (70,553,706,496 parameters)."),
        "llama3_1_8b": (LLAMA3_1_8B, "Llama 3.1 8B: Llama 3 8B shapes with scaled RoPE."),
        "llama3_1_70b": (LLAMA3_1_70B, "Llama 3.1 70B: Llama 3 70B shapes with scaled RoPE."),
        "llama3_2_1b": (LLAMA3_2_1B, "Llama 3.2 1B (1,235,814,400 parameters, tied embeddings)."),
        "llama3_2_3b": (LLAMA3_2_3B, "Llama 3.2 3B (3,212,749,824 parameters, tied embeddings)."),
        "llama_tiny": (LLAMA_TINY, "The embedded default model (~1.6 M parameters)."),
        "llama_small": (LLAMA_SMALL, "The CPU benchmark model (~32 M parameters)."),
        "llama_small_32k": (LLAMA_SMALL_32K, "The CPU memory-benchmark model: 4 blocks of ``llama_small`` with a "
                            "32,768-token vocabulary (~45 M parameters)."),
    },
    torchtune_builders={
        "torchtune.models.llama2.llama2_7b": TorchtuneBuilder("llama2_7b"),
        "torchtune.models.llama3.llama3_8b": TorchtuneBuilder("llama3_8b"),
        "torchtune.models.llama3.llama3_70b": TorchtuneBuilder("llama3_70b"),
        "torchtune.models.llama3_1.llama3_1_8b": TorchtuneBuilder("llama3_1_8b"),
        "torchtune.models.llama3_1.llama3_1_70b": TorchtuneBuilder("llama3_1_70b"),
        "torchtune.models.llama3_2.llama3_2_1b": TorchtuneBuilder("llama3_2_1b"),
        "torchtune.models.llama3_2.llama3_2_3b": TorchtuneBuilder("llama3_2_3b"),
        # torchtune defines Llama 3.3 70B as its Llama 3.1 70B builder (same architecture, new weights).
        "torchtune.models.llama3_3.llama3_3_70b": TorchtuneBuilder("llama3_1_70b"),
    },
    torchtune_packages=tuple(f"torchtune.models.{package}" for package in (
        "llama2", "code_llama2", "llama3", "llama3_1", "llama3_2", "llama3_3")),
)
# The builders are names of this module too (``torchtune_ac.models.families.llama.llama3_8b``).
globals().update(FAMILY.builders)
