"""The gpt-oss family: a decoder whose every MLP is a mixture of experts (``models/moe.py``), with attention sinks.

What it declares as data: a router with a bias whose top k logits are softmaxed (``topk_softmax``); experts with
biases and the clamped SwiGLU (``(up + 1) * gate * sigmoid(alpha * gate)``, the gate clamped above at
``swiglu_limit``, up to [-limit, limit]), their weights ``[E, in, out]`` with gate and up columns interleaved, as
transformers holds them; RMSNorms scaling in float32; layers alternating sliding-window (128) and full attention;
YaRN RoPE; biases on q, k, v and o. What is structure (``GptOssBlock``, here): each attention head's learned sink
logit, which ``attention.causal_attention`` takes as ``sinks`` (FlexAttention on CUDA, explicit scores elsewhere).

Checkpoints: the bf16 layout (``mlp.experts.gate_up_proj``, ``..._bias``, ``down_proj``, ``..._bias``, as
transformers saves it) loads and is written. The published checkpoints store the experts' weights in MXFP4
(``*_blocks`` and ``*_scales``): they are dequantised exactly on load (each 4-bit value times its block's power
of two is a bfloat16 and a float32), and a model is saved in its own dtype, without ``quantization_config``.
"""

from typing import Any, Mapping, Optional

import torch

from torchtune_ac.checkpoint.layout import Encoded
from torchtune_ac.checkpoint.mxfp4 import MXFP4
from torchtune_ac.errors import UserError
from torchtune_ac.models.decoder_family import decoder_family
from torchtune_ac.models.hf_adapter import LlamaStyleHFAdapter, read_value
from torchtune_ac.models.llama import Attention, LlamaArgs, TransformerBlock, YarnRopeScaling
from torchtune_ac.models.moe import ExpertLayout, MoEArgs, RouterSpec

_ROUTER = RouterSpec(scoring="topk_softmax", bias=True)


def _layer_types(n_layers: int) -> tuple[str, ...]:
    # transformers' GptOssConfig default: sliding, full, sliding, full, ...
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers))


def _gpt_oss(n_layers: int, num_experts: int) -> LlamaArgs:
    return LlamaArgs(
        vocab_size=201_088, dim=2880, n_layers=n_layers, n_heads=64, n_kv_heads=8, intermediate_dim=2880,
        max_seq_len=131_072, norm_eps=1e-5, rope_theta=150_000.0,
        rope_scaling=YarnRopeScaling(factor=32.0, original_max_position_embeddings=4096, truncate=False),
        head_dim=64, model_type="gpt_oss", qkv_bias=True, norm_in_float32=True, sliding_window=128,
        layer_types=_layer_types(n_layers),
        moe=MoEArgs(num_experts=num_experts, top_k=4, expert_dim=2880, router=_ROUTER, aux_loss_coef=0.9,
                    experts=ExpertLayout(in_out=True, interleaved=True, bias=True, activation="clamped_swiglu")),
    )


# config.json of openai/gpt-oss-20b and openai/gpt-oss-120b.
GPT_OSS_20B = _gpt_oss(24, 32)
GPT_OSS_120B = _gpt_oss(36, 128)


class GptOssAttention(Attention):
    """``Attention`` with a bias on the output projection too, and a learned sink logit per head."""

    def __init__(self, args: LlamaArgs, window: Optional[int] = None) -> None:
        super().__init__(args, window)
        self.o_proj = torch.nn.Linear(self.n_heads * self.head_dim, args.dim, bias=True)
        self.sinks = torch.nn.Parameter(torch.empty(self.n_heads))



class GptOssBlock(TransformerBlock):
    """gpt-oss's block: ``TransformerBlock`` with ``GptOssAttention``."""

    def __init__(self, args: LlamaArgs, window: Optional[int] = None, layer: int = 0) -> None:
        super().__init__(args, window, layer)
        self.attn = GptOssAttention(args, window)


class GptOssHFAdapter(LlamaStyleHFAdapter):
    """gpt-oss's config.json (attention biases, the attention pattern, the experts)."""

    def args_from_hf_config(self, config: Mapping[str, Any], **overrides: Any) -> LlamaArgs:
        # gpt-oss has q/k/v/o biases (a variant flag and GptOssAttention), which the shared reader refuses.
        if config.get("attention_bias") is False:
            raise UserError("unsupported Hugging Face gpt_oss config: attention_bias=False: gpt-oss has attention "
                            "biases")
        return super().args_from_hf_config({**config, "attention_bias": False}, **overrides)

    def read_family_keys(self, config: Mapping[str, Any], problems: list[str]) -> dict[str, Any]:
        n_layers = config.get("num_hidden_layers")
        layer_types = config.get("layer_types")
        if layer_types is None and isinstance(n_layers, int):
            layer_types = list(_layer_types(n_layers))
        elif not isinstance(layer_types, list):
            problems.append(f"layer_types={layer_types!r}: must be a list")
            layer_types = None
        layout = ExpertLayout(
            in_out=True, interleaved=True, bias=True, activation="clamped_swiglu",
            swiglu_alpha=read_value(config, "swiglu_alpha", float, problems, default=1.702),
            swiglu_limit=read_value(config, "swiglu_limit", float, problems, default=7.0),
        )
        moe = dict(
            num_experts=read_value(config, "num_local_experts", int, problems, default=128),
            top_k=read_value(config, "num_experts_per_tok", int, problems, default=4),
            expert_dim=read_value(config, "intermediate_size", int, problems),
            aux_loss=read_value(config, "output_router_logits", bool, problems, default=False),
            aux_loss_coef=read_value(config, "router_aux_loss_coef", float, problems, default=0.9),
        )
        if None in moe.values() or layout.swiglu_limit is None or layout.swiglu_alpha is None:
            return {}
        return {
            "sliding_window": read_value(config, "sliding_window", int, problems, default=128),
            "layer_types": None if layer_types is None else tuple(layer_types),
            "moe": MoEArgs(router=_ROUTER, experts=layout, **moe),
        }

    def family_architecture(self, args: LlamaArgs) -> dict[str, Any]:
        moe = args.moe
        return {
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "swiglu_alpha": moe.experts.swiglu_alpha, "swiglu_limit": moe.experts.swiglu_limit,
            "sliding_window": args.sliding_window, "layer_types": list(args.layer_types),
        }

    def check_args(self, args: LlamaArgs) -> None:
        super().check_args(args)
        moe = args.moe
        if moe is None or moe.router != _ROUTER or moe.sparse_step != 1 or moe.dense_layers or \
                moe.expert_dim != args.intermediate_dim or moe.experts.activation != "clamped_swiglu" or \
                not (moe.experts.in_out and moe.experts.interleaved and moe.experts.bias):
            raise ValueError(f"moe={moe}: gpt_oss has a biased top-k router and biased, clamped-SwiGLU experts of "
                             "intermediate_dim in every layer")
        if args.layer_types is None:
            raise ValueError("layer_types=None: gpt_oss gives every layer's attention (sliding or full)")

    def hf_config_from_args(self, args: LlamaArgs, dtype: torch.dtype, *,
                            base_config: Optional[Mapping[str, Any]] = None, **token_ids: Any) -> dict[str, Any]:
        # Saved in the model's dtype: the published checkpoints' MXFP4 quantization_config no longer holds.
        base = {k: v for k, v in (base_config or {}).items() if k != "quantization_config"}
        config = super().hf_config_from_args(args, dtype, base_config=base, **token_ids)
        config.update(output_router_logits=args.moe.aux_loss, router_aux_loss_coef=args.moe.aux_loss_coef)
        return config


FAMILY = decoder_family(
    __name__,
    "gpt_oss",
    GptOssHFAdapter(
        model_type="gpt_oss",
        architecture_name="GptOssForCausalLM",
        variant={"qkv_bias": True, "norm_in_float32": True},
        rope_types=("yarn",),
        extra_config={"attention_bias": True},
        # Written in the model's dtype; the published checkpoints' MXFP4 experts are read too.
        storage=(Encoded("mlp.experts.gate_up_proj", MXFP4), Encoded("mlp.experts.down_proj", MXFP4)),
    ),
    {
        "gpt_oss_20b": (GPT_OSS_20B, "gpt-oss-20b (20,914,757,184 parameters, 32 experts, 4 per token)."),
        "gpt_oss_120b": (GPT_OSS_120B, "gpt-oss-120b (116,829,156,672 parameters, 128 experts, 4 per token)."),
    },
    block=GptOssBlock,
    tensor_parallel=False,
)
# The builders are names of this module too (``torchtune_ac.models.families.gpt_oss.gpt_oss_20b``).
globals().update(FAMILY.builders)
