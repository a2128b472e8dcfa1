"""``tune run full_finetune --config tiny/moe``: a mixture of experts trains from random weights with packed rows
and per-op AC, logs its load-balancing loss and the tokens each expert received, and writes a checkpoint that
transformers' Qwen3MoeForCausalLM loads; ``full_dpo`` trains it with its experts split over 2 processes."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from finetune_runs import check_success, final_checkpoint, run_tune_in_process, run_tune_subprocess
from numerics import assert_close, llama_terms
from transformers import Qwen3MoeForCausalLM

from torchtune_ac.models import load_hf
from torchtune_ac.observability.metrics import read_metrics


def test_the_tiny_moe_config_trains_packed_with_per_op_ac_and_reports_its_experts(tmp_path: Path) -> None:
    output_dir = tmp_path / "run"
    check_success(run_tune_in_process([
        "run", "full_finetune", "--config", "tiny/moe", f"output_dir={output_dir}", "max_steps_per_epoch=2",
        "batch_size=4", "dataset.packed=true", "ac_mode=selective", "ac_option=op"]))
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        # Balanced routing gives E * sum_e (k / E) * (1 / E) = k = 2.
        assert math.isfinite(record["moe_aux_loss"]) and 1.5 < record["moe_aux_loss"] < 4
        expert_tokens = record["moe_expert_tokens"]
        assert len(expert_tokens) == 3 and all(len(layer) == 8 for layer in expert_tokens)  # 3 sparse layers
        # Dropless: every token reaches its 2 experts in every sparse layer.
        assert all(sum(layer) == 2 * record["tokens"] for layer in expert_tokens)
    checkpoint = final_checkpoint(output_dir)
    ours = load_hf(checkpoint).eval()
    theirs = Qwen3MoeForCausalLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(ours(tokens), theirs(tokens).logits, terms=llama_terms(ours.args, 16, 0, backward=False),
                     what="logits")


def test_the_published_moe_configs_validate_with_their_parameter_counts(capsys) -> None:
    from torchtune_ac.cli import main

    for config, parameters in (("qwen3_moe/30B_A3B_full", "30,532,122,624"), ("gpt_oss/20B_full", "20,914,757,184")):
        assert main(["validate", "--config", config]) == 0
        assert f": {parameters} parameters, " in capsys.readouterr().out


def test_dpo_trains_a_mixture_of_experts_split_over_2_processes_with_its_load_balancing_loss(tmp_path: Path) -> None:
    """``full_dpo`` on the tiny MoE with its experts split over 2 processes (EP 2), packed pairs, per-op AC and the
    precomputed reference: the load-balancing loss is added to the DPO loss, as TRL's DPOTrainer adds it. At the
    first step the policy is the reference, so its DPO loss is ln 2 exactly: the loss is ln 2 + coef x aux."""
    output_dir = tmp_path / "dpo"
    check_success(run_tune_subprocess([
        "run", "--nproc_per_node", "2", "full_dpo", "--config", "tiny/dpo", f"output_dir={output_dir}",
        "model._component_=torchtune_ac.models.qwen3_moe_tiny", "checkpoint_dir=null",
        "tokenizer.path=${embedded_checkpoint:}", "max_steps_per_epoch=2", "expert_parallel_dim=2",
        "dpo.reference=precomputed", "dataset.packed=true", "max_seq_len=256", "ac_mode=selective", "ac_option=op"]))
    first, second = read_metrics(output_dir)
    assert math.isclose(first["loss"], math.log(2) + 0.01 * first["moe_aux_loss"], rel_tol=1e-5), first
    # The two terms logged apart: the DPO loss, ln 2 at the first step, and the auxiliary term; loss is their sum.
    assert math.isclose(first["dpo_loss"], math.log(2), rel_tol=1e-5), first
    assert math.isclose(first["moe_aux_term"], 0.01 * first["moe_aux_loss"], rel_tol=1e-5), first
    assert math.isclose(first["loss"], first["dpo_loss"] + first["moe_aux_term"], rel_tol=1e-6), first
    assert all(len(layer) == 8 for layer in first["moe_expert_tokens"])
    assert second["loss"] < first["loss"] and math.isfinite(second["moe_aux_loss"])
