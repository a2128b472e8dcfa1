"""The Qwen3-MoE family: builders (published shapes, exact parameter counts), config.json translation, dense and
sparse layers, and checkpoints with per-expert or fused expert tensors. Logits, round trip and AC against
transformers' Qwen3MoeForCausalLM are in ``tests/unit/checkpoint/test_family_parity.py``."""

import json

import pytest
import torch
from hf_families import random_hf_model, write_hf_checkpoint
from safetensors.torch import load_file, save_file

import torchtune_ac.models.families.qwen3_moe as qwen3_moe
from torchtune_ac.errors import UserError
from torchtune_ac.models import QWEN3_MOE, family_for_hf_config, gpt_oss_20b, load_hf, read_hf_args, save_hf
from torchtune_ac.models.llama import MLP
from torchtune_ac.models.moe import MoE, MoEArgs

PARAMETER_COUNTS = {"qwen3_moe_30b_a3b": 30_532_122_624, "qwen3_moe_235b_a22b": 235_093_634_560}
# Qwen/Qwen3-30B-A3B's config.json (the keys that matter).
PUBLISHED_30B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(PARAMETER_COUNTS))
def test_parameter_count_on_meta(name):
    with torch.device("meta"):
        model = getattr(qwen3_moe, name)()
    assert sum(p.numel() for p in model.parameters()) == PARAMETER_COUNTS[name]
    assert all(isinstance(layer.mlp, MoE) for layer in model.layers)


def test_the_published_config_json_translates_to_the_builder_args():
    assert family_for_hf_config(PUBLISHED_30B) is QWEN3_MOE
    assert QWEN3_MOE.hf.args_from_hf_config(PUBLISHED_30B) == qwen3_moe.QWEN3_MOE_30B_A3B


def test_sparse_step_and_mlp_only_layers_mix_dense_and_sparse_layers():
    config = {**PUBLISHED_30B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    with torch.device("meta"):
        model = QWEN3_MOE.build(QWEN3_MOE.hf.args_from_hf_config(config))
    # transformers: sparse where (i + 1) % step == 0, unless i is in mlp_only_layers.
    assert [type(layer.mlp) for layer in model.layers] == [MLP, MoE, MLP, MLP, MLP, MoE]
    assert model.layers[0].mlp.gate_proj.weight.shape == (6144, 2048)
    assert QWEN3_MOE.hf.architecture(model.args)["mlp_only_layers"] == [3]


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True}, "use_sliding_window=True: sliding-window attention is not supported"),
    ({"num_experts": 0}, "num_experts=0: a Qwen3-MoE model without experts is a dense Qwen3"),
    ({"mlp_only_layers": ["a"]}, "mlp_only_layers=['a']: must be a list of layer indices"),
    ({"num_experts_per_tok": 200}, "moe.top_k=200 must be at most num_experts=128"),
])
def test_unsupported_configs_name_the_key(change, message):
    with pytest.raises(UserError, match="qwen3_moe config") as info:
        QWEN3_MOE.hf.args_from_hf_config({**PUBLISHED_30B, **change})
    assert message in str(info.value)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_router_aux_loss_coef_is_refused_naming_the_key_and_the_file(tmp_path, value):
    """NaN and Infinity (which Python's json reads) passed, and the run stopped with exit 3 after step 1."""
    (tmp_path / "config.json").write_text(json.dumps({**PUBLISHED_30B, "router_aux_loss_coef": value}))
    with pytest.raises(UserError) as info:
        read_hf_args(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: ")
    assert f"router_aux_loss_coef={value!r}: must be a finite number" in str(info.value)
    assert MoEArgs(num_experts=8, top_k=2, expert_dim=16, aux_loss_coef=value).problems() == [
        f"moe.aux_loss_coef={value} must be a finite number, not negative"]


def test_a_checkpoint_with_fused_experts_loads_and_saves_per_expert_as_published(tmp_path):
    reference = random_hf_model("qwen3_moe", seed=2)
    reference.save_pretrained(tmp_path / "per_expert")
    per_expert = load_hf(tmp_path / "per_expert")
    # The same weights in transformers 5's in-memory layout: experts.gate_up_proj [E, 2 * h, dim], down_proj.
    (tmp_path / "fused").mkdir()
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    save_file({name: tensor.contiguous() for name, tensor in reference.state_dict().items()},
              tmp_path / "fused" / "model.safetensors")
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(tmp_path / "fused" / "model.safetensors")
    fused = load_hf(tmp_path / "fused")
    for name, tensor in per_expert.state_dict().items():
        assert torch.equal(fused.state_dict()[name], tensor), name

    save_hf(fused, tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert sorted(saved) == sorted(load_file(tmp_path / "per_expert" / "model.safetensors"))
    gate_up = fused.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(saved["model.layers.1.mlp.experts.3.up_proj.weight"], gate_up[3, 16:])
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["num_experts"] == 4


def test_a_checkpoint_with_another_expert_count_or_a_missing_expert_is_refused(tmp_path):
    write_hf_checkpoint("qwen3_moe", tmp_path, seed=3)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_local_experts": 8}))
    with pytest.raises(UserError, match=r"mlp.gate.weight has shape \[4, 32\], expected \[8, 32\]"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match="missing parts of model.layers.1.mlp.experts.gate_up_proj"):
        load_hf(tmp_path)


def test_tensor_parallelism_is_refused_in_one_line():
    from torchtune_ac.parallel.tensor_parallel import check_tensor_parallel_degree

    for builder in (qwen3_moe.qwen3_moe_tiny, gpt_oss_20b):
        with torch.device("meta"):
            model = builder()
        with pytest.raises(UserError, match=r"tensor_parallel_dim: family \w+ declares no tensor-parallel plan; set "
                                            "tensor_parallel_dim: 1"):
            check_tensor_parallel_degree(model, 2)
