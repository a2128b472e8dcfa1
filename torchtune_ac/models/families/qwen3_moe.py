"""The Qwen3-MoE family: Qwen3's decoder (q/k norms before RoPE, head_dim 128) whose MLPs are mixtures of experts
(``models/moe.py``).

What it declares as data: a softmax router without bias, top k of the probabilities, renormalised to sum to 1
(``norm_topk_prob``); SwiGLU experts without biases whose weights are stacked as ``nn.Linear``s hold them
(``gate_up_proj [E, 2 * moe_intermediate_size, hidden]``, gate half first; ``down_proj [E, hidden,
moe_intermediate_size]``); MoE layers every ``decoder_sparse_step``-th layer but those in ``mlp_only_layers``,
which keep a dense MLP of ``intermediate_size``.

Checkpoints: the published ones (and transformers' ``save_pretrained``) store each expert's
``mlp.experts.{e}.{gate,up,down}_proj.weight``; checkpoints with the fused ``mlp.experts.gate_up_proj`` and
``mlp.experts.down_proj`` (transformers 5's in-memory layout) load too. A model is saved per expert, as published.
"""

from typing import Any, Mapping, Optional

import torch

from torchtune_ac.checkpoint.layout import EACH, Split
from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.family import TorchtuneBuilder
from torchtune_ac.models.hf_adapter import LLAMA_BLOCK_NAMES, LlamaStyleHFAdapter, Refusal, read_value, refuse_truthy
from torchtune_ac.models.llama import LlamaArgs
from torchtune_ac.models.moe import MoEArgs, RouterSpec

_ROUTER = RouterSpec(scoring="softmax_topk", norm_topk_prob=True)


def _qwen3_moe(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, num_experts: int, expert_dim: int,
               intermediate_dim: int) -> LlamaArgs:
    return LlamaArgs(
        vocab_size=151_936, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
        intermediate_dim=intermediate_dim, max_seq_len=40_960, norm_eps=1e-6, rope_theta=1_000_000.0,
        head_dim=None if dim == n_heads * 128 else 128, model_type="qwen3_moe", qk_norm=True,
        moe=MoEArgs(num_experts=num_experts, top_k=8, expert_dim=expert_dim, router=_ROUTER),
    )


# config.json of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (intermediate_size is unused: every layer is sparse).
QWEN3_MOE_30B_A3B = _qwen3_moe(2048, 48, 32, 4, 128, 768, 6144)
QWEN3_MOE_235B_A22B = _qwen3_moe(4096, 94, 64, 4, 128, 1536, 12_288)

# The CI model (embedded tokenizer's vocabulary): a dense first layer, then 3 sparse ones of 8 experts, 2 per token,
# trained with the load-balancing loss.
QWEN3_MOE_TINY = LlamaArgs(
    vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_dim=352, max_seq_len=512,
    norm_eps=1e-6, rope_theta=1_000_000.0, model_type="qwen3_moe", qk_norm=True,
    moe=MoEArgs(num_experts=8, top_k=2, expert_dim=64, router=_ROUTER, dense_layers=(0,), aux_loss=True,
                aux_loss_coef=0.01),
)

class Qwen3MoeHFAdapter(LlamaStyleHFAdapter):
    """Qwen3-MoE's config.json (its MoE keys) and its experts' tensors, per expert or fused."""

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        # transformers 5 writes num_experts as num_local_experts (its attribute map), the published files num_experts.
        experts_key = "num_experts" if "num_experts" in config else "num_local_experts"
        n_experts = read_value(config, experts_key, int, problems, default=128)
        dense = read_value(config, "mlp_only_layers", list, problems, default=[])
        moe = dict(
            num_experts=n_experts,
            top_k=read_value(config, "num_experts_per_tok", int, problems, default=8),
            expert_dim=read_value(config, "moe_intermediate_size", int, problems, default=768),
            router=RouterSpec(scoring="softmax_topk",
                              norm_topk_prob=read_value(config, "norm_topk_prob", bool, problems, default=False)),
            sparse_step=read_value(config, "decoder_sparse_step", int, problems, default=1),
            dense_layers=tuple(dense or ()),
            aux_loss=read_value(config, "output_router_logits", bool, problems, default=False),
            aux_loss_coef=read_value(config, "router_aux_loss_coef", float, problems, default=0.001),
        )
        if n_experts == 0:
            problems.append(f"{experts_key}=0: a Qwen3-MoE model without experts is a dense Qwen3 (model_type qwen3)")
        if not all(isinstance(layer, int) and not isinstance(layer, bool) for layer in moe["dense_layers"]):
            problems.append(f"mlp_only_layers={dense!r}: must be a list of layer indices")
        if problems:
            return {}
        return {"moe": MoEArgs(**moe)}

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        moe = args.moe
        return {
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.expert_dim,
            "norm_topk_prob": moe.router.norm_topk_prob, "decoder_sparse_step": moe.sparse_step,
            "mlp_only_layers": list(moe.dense_layers),
        }

    def check_args(self, args: LlamaArgs) -> None:
        super().check_args(args)
        moe = args.moe
        if moe is None:
            raise ValueError("moe=None: a qwen3_moe model has mixture-of-experts layers (set moe)")
        if moe.router != RouterSpec(scoring="softmax_topk", norm_topk_prob=moe.router.norm_topk_prob) or \
                moe.experts.in_out or moe.experts.interleaved or moe.experts.bias or moe.experts.activation != "silu":
            raise ValueError(f"moe={moe}: qwen3_moe has a softmax router without bias and SwiGLU experts without "
                             "biases, stacked as nn.Linear weights")

    def hf_config_from_args(self, args: LlamaArgs, dtype: torch.dtype, *,
                            base_config: Optional[Mapping[str, Any]] = None, **token_ids: Any) -> dict[str, Any]:
        config = super().hf_config_from_args(args, dtype, base_config=base_config, **token_ids)
        config.update(output_router_logits=args.moe.aux_loss, router_aux_loss_coef=args.moe.aux_loss_coef)
        return config


FAMILY = decoder_family(
    __name__,
    "qwen3_moe",
    Qwen3MoeHFAdapter(
        model_type="qwen3_moe",
        architecture_name="Qwen3MoeForCausalLM",
        variant={"qk_norm": True},
        refusals=(
            Refusal("use_sliding_window", refuse_truthy("sliding-window attention is not supported for Qwen3-MoE")),
        ),
        # The router is Hugging Face's ``mlp.gate``.
        block_names=(*LLAMA_BLOCK_NAMES[:3], ("mlp.router.", "mlp.gate."), ("mlp.", "mlp.")),
        extra_config={"attention_bias": False, "use_sliding_window": False, "sliding_window": None},
        # One tensor per expert and projection, as published (written so); transformers 5's fused ones read too.
        storage=(
            Split("mlp.experts.gate_up_proj", "mlp.experts.{0}.{1}.weight", (EACH, ("gate_proj", "up_proj")),
                  whole_too=True),
            Split("mlp.experts.down_proj", "mlp.experts.{0}.down_proj.weight", (EACH,), whole_too=True),
        ),
    ),
    {
        "qwen3_moe_30b_a3b": (QWEN3_MOE_30B_A3B, "Qwen3-30B-A3B (30,532,122,624 parameters, 128 experts, 8 per "
                                                 "token)."),
        "qwen3_moe_235b_a22b": (QWEN3_MOE_235B_A22B, "Qwen3-235B-A22B (235,093,634,560 parameters, 128 experts, 8 "
                                                     "per token)."),
        "qwen3_moe_tiny": (QWEN3_MOE_TINY, "The CI mixture of experts (~1.1 M parameters, 8 experts, 2 per token, "
                                           "with the load-balancing loss)."),
    },
    tensor_parallel=False,
    torchtune_packages=(),
)
# The builders are names of this module too (``torchtune_ac.models.families.qwen3_moe.qwen3_moe_30b_a3b``).
globals().update(FAMILY.builders)
