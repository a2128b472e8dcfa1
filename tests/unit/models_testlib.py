"""Helpers shared by the model tests: tiny argument sets, random models and checkpoints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from hf_families import randomize_
from transformers import LlamaConfig, LlamaForCausalLM

from torchtune_ac.models import Llama, LlamaArgs, RopeScaling, save_hf

TINY = LlamaArgs(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=64, max_seq_len=128)

# name -> LlamaArgs; each exercises a different part of the name / shape / RoPE translation.
PARITY_CASES = {
    "mha_untied": dataclasses.replace(TINY, n_kv_heads=4),
    "gqa_untied": TINY,
    "mqa_tied": dataclasses.replace(TINY, n_kv_heads=1, tie_embeddings=True),
    "gqa_tied_theta": dataclasses.replace(TINY, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-6),
    # original_max_position_embeddings far below the test sequence length, so all three bands of the
    # Llama 3.1 frequency scaling are exercised.
    "llama3_rope_scaling": dataclasses.replace(
        TINY,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16),
    ),
    "head_dim_not_dim_over_heads": dataclasses.replace(TINY, head_dim=16),
}


def build_random_llama(args: LlamaArgs, seed: int = 0) -> Llama:
    model = Llama(args)
    randomize_(model, seed)
    return model.eval()


def build_random_hf_llama(args: LlamaArgs, seed: int = 0) -> LlamaForCausalLM:
    """A random transformers ``LlamaForCausalLM`` with the shapes of ``args`` (eager attention, fp32)."""
    scaling = args.rope_scaling
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": args.rope_theta, **dataclasses.asdict(scaling)}
    config = LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        intermediate_size=args.intermediate_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        head_dim=args.resolved_head_dim,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        rope_parameters=rope,
        tie_word_embeddings=args.tie_embeddings,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config)
    randomize_(model, seed)
    return model.eval()


def save_random_checkpoint(out_dir: Path, args: LlamaArgs = TINY, seed: int = 0, **save_kwargs) -> Path:
    """A valid checkpoint written by ``save_hf`` from a random model."""
    return save_hf(build_random_llama(args, seed), out_dir, **save_kwargs)


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit for bit: for states copied (saved, loaded, drawn from the same seed), never computed two ways."""
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name
