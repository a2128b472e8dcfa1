"""The Phi-3 family (``model_type: phi3``, transformers' ``Phi3ForCausalLM``), which Phi-3.5 and Phi-4 share: the
Llama decoder, with its checkpoints' q/k/v and gate/up weights each stored as one tensor.

What is storage: a checkpoint's ``self_attn.qkv_proj`` holds q, k and v stacked (rows of the query heads, then the
key heads, then the value heads) and ``mlp.gate_up_proj`` the gate above the up projection; they are read into, and
written from, the decoder's own projections (so tensor parallelism splits q/k/v heads and MLP columns as Llama's).
What is data: the sliding window (every layer slides when config.json sets ``sliding_window``: 2,047 tokens for
Phi-3-mini-4k and -medium-4k, 262,144 for the 128k models, none for Phi-4), partial rotary embeddings
(``partial_rotary_factor``: Phi-4-mini's 0.75) and LongRoPE (``rope_scaling.type: longrope``, or its older names
``su`` and ``yarn``, with the original length in config.json's top-level ``original_max_position_embeddings``, as
transformers reads them). ``resid_pdrop`` is the residual dropout; ``embd_pdrop``, which transformers does not apply,
is kept in config.json and not applied either.
"""

from typing import Any, Mapping, Optional

import torch

from torchtune_ac.checkpoint.layout import Stacked
from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, read_value
from torchtune_ac.models.llama import LlamaArgs, LongRopeScaling

PHI3_MINI = LlamaArgs(vocab_size=32_064, dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_dim=8192,
                      max_seq_len=4096, norm_eps=1e-5, rope_theta=10_000.0, model_type="phi3", sliding_window=2047)
PHI4_14B = LlamaArgs(vocab_size=100_352, dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, intermediate_dim=17_920,
                     max_seq_len=16_384, norm_eps=1e-5, rope_theta=250_000.0, model_type="phi3")

# transformers' Phi3Config default, which it reads LongRoPE's original length from whatever rope_scaling says.
_ORIGINAL_LENGTH = 4096
_LONGROPE_NAMES = ("longrope", "su", "yarn")  # Phi3Config reads the older two as longrope


class Phi3HFAdapter(LlamaStyleHFAdapter):
    """Phi-3's config.json: LongRoPE's original length at the top level, partial rotary embeddings, the sliding
    window of every layer, the residual dropout ``resid_pdrop``."""

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> LlamaArgs:
        return super().args_from_hf_config(_standard_rope(config), **overrides)

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        rope = config.get("rope_parameters")  # transformers 5 keeps partial_rotary_factor there
        partial = None
        if isinstance(rope, Mapping):
            partial = read_value(rope, "partial_rotary_factor", float, problems, default=None,
                                 prefix="rope_parameters.")
        if partial is None:
            partial = read_value(config, "partial_rotary_factor", float, problems, default=1.0)
        return {
            "sliding_window": read_value(config, "sliding_window", int, problems, default=None),
            "partial_rotary_factor": 1.0 if partial is None else partial,
            "resid_dropout": read_value(config, "resid_pdrop", float, problems, default=0.0),
        }

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        keys = {"sliding_window": args.sliding_window, "partial_rotary_factor": args.partial_rotary_factor}
        if isinstance(args.rope_scaling, LongRopeScaling):
            keys["original_max_position_embeddings"] = args.rope_scaling.original_max_position_embeddings
        return keys

    def hf_config_from_args(self, args: LlamaArgs, dtype: torch.dtype, *,
                            base_config: Optional[Mapping[str, Any]] = None, **token_ids: Any) -> dict[str, Any]:
        config = super().hf_config_from_args(args, dtype, base_config=base_config, **token_ids)
        config["resid_pdrop"] = args.resid_dropout
        if isinstance(args.rope_scaling, LongRopeScaling):
            # The length LongRoPE extends to, not the run's max_seq_len: readers that derive the attention factor
            # from it (vLLM) then compute the one this model used.
            config["max_position_embeddings"] = args.rope_scaling.max_position_embeddings
        return config


def _standard_rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with LongRoPE's settings as the shared reader takes them: ``rope_type: longrope`` (not ``su`` or
    ``yarn``), and the original length Phi3Config reads (its top-level ``original_max_position_embeddings``, 4096
    when absent) in them."""
    config = dict(config)
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key)
    if isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) in _LONGROPE_NAMES:
        rope = {k: v for k, v in rope.items() if k != "type"}
        rope["rope_type"] = "longrope"
        rope["original_max_position_embeddings"] = config.get("original_max_position_embeddings", _ORIGINAL_LENGTH)
        config[key] = rope
    return config


FAMILY = decoder_family(
    __name__,
    "phi3",
    Phi3HFAdapter(
        model_type="phi3",
        architecture_name="Phi3ForCausalLM",
        rope_types=("longrope",),
        storage=(
            Stacked("self_attn.qkv_proj.weight",
                    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
            Stacked("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
        ),
    ),
    {
        "phi3_mini": (PHI3_MINI, "Phi-3 mini 4k (3,821,079,552 parameters; a 2,047-token sliding window)."),
        "phi4_14b": (PHI4_14B, "Phi-4 14B (14,659,507,200 parameters)."),
    },
    torchtune_builders={
        "torchtune.models.phi3.phi3_mini": TorchtuneBuilder(
            "phi3_mini", "torchtune's phi3_mini attends over the whole sequence; Phi-3-mini-4k's config.json, "
            "transformers and ours slide a 2,047-token window"),
        "torchtune.models.phi4.phi4_14b": TorchtuneBuilder("phi4_14b"),
    },
    torchtune_packages=("torchtune.models.phi3", "torchtune.models.phi4"),
)
# The builders are names of this module too (``torchtune_ac.models.families.phi3.phi4_14b``).
globals().update(FAMILY.builders)
