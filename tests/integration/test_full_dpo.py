"""``tune run full_dpo --config tiny/dpo``: step 0 is exact (every pair's loss ln 2), the rewards and validation are
logged, checkpoints load in transformers, and what ``full_finetune`` guarantees holds for it too: activation
checkpointing and the step in backward change nothing, 8-bit optimizer state trains, a precomputed reference
trains as a resident one, SIGTERM saves and the run resumes exactly (on 1 process, and from 2 onto 1), 2 processes
train as 1, and bad keys are one line."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    DROPOUT,
    check_success,
    final_checkpoint,
    load_weights,
    read_losses,
    run_tune_in_process,
    run_tune_subprocess,
    subprocess_env,
)
from numerics import assert_close, assert_steps_alike, assert_weights_trained_alike, llama_terms
from test_fault_injection import _assert_stopped, _signal_after_steps

from torchtune_ac.models import load_hf
from torchtune_ac.models.families.llama import LLAMA_TINY
from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.training.dpo import DPO_METRICS

PAIRS_PER_STEP = 4
# 4 pairs a step (8 rows of at most 64 tokens); tiny/dpo validates every 20 steps, after these runs end.
SHORT = ("max_seq_len=64", f"batch_size={PAIRS_PER_STEP}")
TERMS = llama_terms(LLAMA_TINY, 64, 2 * PAIRS_PER_STEP * 64)


def dpo_argv(output_dir: Path, *overrides: str, nproc: int = 1) -> list[str]:
    launcher = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    return ["run", *launcher, "full_dpo", "--config", "tiny/dpo", *SHORT, f"output_dir={output_dir}", *overrides]


@pytest.fixture(scope="module")
def validated_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps, validating on the held-out pairs every 2."""
    output_dir = tmp_path_factory.mktemp("dpo") / "run"
    check_success(run_tune_in_process(dpo_argv(output_dir, "max_steps_per_epoch=4", "batch_size_val=50",
                                               "run_val_every_n_steps=2")))
    return output_dir


def test_step_zero_costs_ln2_per_pair_with_zero_rewards_and_half_accuracy(validated_run: Path) -> None:
    first = read_metrics(validated_run)[0]
    # The reference is the starting weights, run through the same ops: every log-ratio is 0, each pair's loss is
    # float32(ln 2), and their mean rounds PAIRS_PER_STEP additions.
    assert_close(first["loss"], math.log(2), terms=PAIRS_PER_STEP, what="the first loss")
    assert first["rewards_chosen"] == first["rewards_rejected"] == first["rewards_margin"] == 0.0
    assert first["rewards_accuracy"] == 0.5  # every pair a tie, counted one half
    assert first["logps_chosen"] > first["logps_rejected"]  # the hedged answers are longer


def test_every_step_logs_the_rewards_and_validation_the_held_out_accuracy(validated_run: Path) -> None:
    records = read_metrics(validated_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert set(DPO_METRICS) <= set(record)
        assert record["target_tokens"] > 2 * PAIRS_PER_STEP  # the answers' tokens, not the pairs
    validated = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in validated] == [2, 4]
    assert all({f"val_{name}" for name in DPO_METRICS} <= set(r) for r in validated)
    assert 0.0 <= validated[-1]["val_rewards_accuracy"] <= 1.0
    assert records[-1]["loss"] < records[0]["loss"]  # it learns


def test_checkpoint_loads_in_transformers_with_the_same_logits(validated_run: Path) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = final_checkpoint(validated_run)
    ours = load_hf(checkpoint).eval()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(hf(tokens).logits, ours(tokens), terms=llama_terms(ours.args, 24, 0, backward=False))


# ---------------------------------------------------------------------------------- what full_finetune guarantees

STEPS = 3


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """No AC, dropout on: the run the others are compared with."""
    output_dir = tmp_path_factory.mktemp("dpo_plain") / "run"
    check_success(run_tune_in_process(dpo_argv(output_dir, f"max_steps_per_epoch={STEPS}",
                                               "enable_activation_checkpointing=false", *DROPOUT)))
    return output_dir


def _same_run_bit_for_bit(output_dir: Path, reference: Path) -> None:
    ours, expected = read_metrics(output_dir), read_metrics(reference)
    for a, b in zip(ours, expected, strict=True):
        assert [a[k] for k in ("loss", *DPO_METRICS)] == [b[k] for k in ("loss", *DPO_METRICS)], (a, b)
    weights, expected_weights = load_weights(final_checkpoint(output_dir)), load_weights(final_checkpoint(reference))
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)


@pytest.mark.parametrize("overrides", [("ac_mode=full",), ("ac_mode=selective", "ac_option=2"),
                                       ("ac_mode=selective", "ac_option=op"), ("optimizer_in_bwd=true",
                                                                                "enable_activation_checkpointing=false",
                                                                                "clip_grad_norm=null")],
                         ids=["full", "every_2nd_block", "per_op", "step_in_backward"])
def test_ac_and_the_step_in_backward_change_nothing(overrides, tmp_path: Path, plain_run: Path) -> None:
    if "optimizer_in_bwd=true" in overrides:  # its reference: the same run without clipping
        reference = tmp_path / "plain_unclipped"
        check_success(run_tune_in_process(dpo_argv(reference, f"max_steps_per_epoch={STEPS}", *DROPOUT,
                                                   "enable_activation_checkpointing=false", "clip_grad_norm=null")))
    else:
        reference = plain_run
    check_success(run_tune_in_process(dpo_argv(tmp_path / "run", f"max_steps_per_epoch={STEPS}", *DROPOUT,
                                               *overrides)))
    # Bit for bit: one process, the same ops replayed (AC) or stepped at another time (in backward).
    _same_run_bit_for_bit(tmp_path / "run", reference)


def test_8_bit_optimizer_state_trains(tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    check_success(run_tune_in_process(dpo_argv(tmp_path, "max_steps_per_epoch=4",
                                               "optimizer._component_=torchao.optim.AdamW8bit")))
    losses = read_losses(tmp_path)
    assert losses[0] == pytest.approx(math.log(2)) and losses[-1] < losses[0]


def test_a_precomputed_reference_trains_as_a_resident_one(tmp_path: Path, plain_run: Path) -> None:
    check_success(run_tune_in_process(dpo_argv(tmp_path, f"max_steps_per_epoch={STEPS}", *DROPOUT,
                                               "enable_activation_checkpointing=false", "dpo.reference=precomputed")))
    # Its log-probabilities came from other batches (other padding): the same within rounding.
    ours, expected = read_metrics(tmp_path), read_metrics(plain_run)
    for name in ("loss", "grad_norm"):
        assert_steps_alike([r[name] for r in ours], [r[name] for r in expected], terms=TERMS, what=name)
    assert_weights_trained_alike(load_weights(final_checkpoint(tmp_path)), load_weights(final_checkpoint(plain_run)),
                                 lrs=[r["lr"] for r in expected], terms=TERMS)


def test_packed_pairs_train_from_ln2_with_a_precomputed_reference_and_plan(tmp_path: Path, capsys) -> None:
    from torchtune_ac.cli import main

    # Rows of 2 x 128 tokens: three or four of the embedded pairs each.
    check_success(run_tune_in_process(dpo_argv(tmp_path, "max_seq_len=128", "max_steps_per_epoch=2", "batch_size=1",
                                               "dataset.packed=true", "dpo.reference=precomputed", "dataset_val=null",
                                               "run_val_every_n_steps=null")))
    first = read_metrics(tmp_path)[0]
    assert first["tokens"] <= 256 and first["target_tokens"] > 0
    # One row of several pairs: its reference came from another forward over the same row, so the log-ratios are
    # 0 within rounding; every pair's loss ln 2 within that.
    assert_close(first["loss"], math.log(2), terms=TERMS, what="the first loss")
    assert first["rewards_accuracy"] == pytest.approx(0.5, abs=0.5)
    assert main(["plan", "--config", "tiny/dpo", "dataset.packed=true", "max_seq_len=64"]) == 0
    assert "full " in capsys.readouterr().out


# ------------------------------------------------------------------------------------------ stop, resume, 2 processes

RESUME_STEPS, SAVE_EVERY = 6, 2


def _resumable(output_dir: Path, *extra: str, nproc: int = 1) -> list[str]:
    return dpo_argv(output_dir, f"max_steps_per_epoch={RESUME_STEPS}", f"save_every_n_steps={SAVE_EVERY}",
                    f"batch_size={PAIRS_PER_STEP // nproc}", *extra, nproc=nproc)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("dpo_resume") / "uninterrupted"
    check_success(run_tune_in_process(_resumable(output_dir)))
    return output_dir


@pytest.mark.slow
def test_sigterm_saves_and_the_resumed_run_is_the_uninterrupted_one(tmp_path: Path, uninterrupted: Path) -> None:
    output_dir = tmp_path / "run"
    code, stderr = _signal_after_steps(_resumable(output_dir), tmp_path / "log", 2, signal.SIGTERM)
    stopped_at = _assert_stopped(code, stderr, "SIGTERM", output_dir, nproc=1)
    assert stopped_at < RESUME_STEPS
    check_success(run_tune_subprocess(_resumable(output_dir, "resume_from_checkpoint=true")))
    # Bit for bit: the same process count and batches, resumed from the exact saved state (the reference rebuilt
    # from the starting weights, not from the checkpoint).
    assert [r["step"] for r in read_metrics(output_dir)] == list(range(1, RESUME_STEPS + 1))
    _same_run_bit_for_bit(output_dir, uninterrupted)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_train_as_one_and_resume_on_one(tmp_path: Path, uninterrupted: Path) -> None:
    two = tmp_path / "two"
    code, stderr = _signal_after_steps(_resumable(two, nproc=2), tmp_path / "log", 2, signal.SIGTERM)
    _assert_stopped(code, stderr, "SIGTERM", two, nproc=2)
    check_success(run_tune_subprocess(_resumable(two, "resume_from_checkpoint=true")))  # resharded: 2 -> 1
    ours, expected = read_metrics(two), read_metrics(uninterrupted)
    assert [r["step"] for r in ours] == list(range(1, RESUME_STEPS + 1))
    for name in ("loss", "grad_norm", "rewards_margin"):
        assert_steps_alike([r[name] for r in ours], [r[name] for r in expected], terms=TERMS, what=name)
    assert_weights_trained_alike(load_weights(final_checkpoint(two)), load_weights(final_checkpoint(uninterrupted)),
                                 lrs=[r["lr"] for r in expected], terms=TERMS)


# ------------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "override, message",
    [
        ("dpo.beta=0", "dpo.beta=0.0: must be > 0.0"),
        ("dpo.loss_type=hinge", "dpo.loss_type='hinge': expected one of sigmoid, ipo"),
        ("dpo.reference=cached", "dpo.reference='cached'"),
        ("dpo.label_smoothing=0.5", "dpo.label_smoothing=0.5: must be < 0.5"),  # ln 2 whatever the policy
    ],
)
def test_bad_dpo_keys_are_one_line_and_nothing_is_written(override, message, tmp_path: Path) -> None:
    result = run_tune_subprocess(dpo_argv(tmp_path / "out", override))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def test_each_recipe_refuses_the_others_config_naming_both_before_anything_is_written(tmp_path: Path) -> None:
    result = run_tune_in_process(["run", "full_dpo", "--config", "tiny/full", f"output_dir={tmp_path / 'a'}"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert ("makes samples, which the full_finetune recipe trains on; the full_dpo recipe trains on preference "
            "pairs") in result.stderr.strip().splitlines()[-1]
    result = run_tune_in_process(["run", "full_finetune", "--config", "tiny/dpo", f"output_dir={tmp_path / 'b'}"])
    assert result.returncode == 2 and "dpo: unknown key (a key of the full_dpo recipe" in result.stderr, result.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_label_smoothing_with_ipo_and_a_missing_reference_are_one_line(tmp_path: Path) -> None:
    result = run_tune_subprocess(dpo_argv(tmp_path / "a", "dpo.loss_type=ipo", "dpo.label_smoothing=0.1"))
    assert result.returncode == 2 and "only the sigmoid loss has label smoothing" in result.stderr, result.stderr
    result = run_tune_subprocess(dpo_argv(tmp_path / "b", f"ref_checkpoint_dir={tmp_path / 'nowhere'}"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert str(tmp_path / "nowhere") in result.stderr.strip().splitlines()[-1]


def test_validate_and_plan_answer_for_every_dpo_config(capsys) -> None:
    from torchtune_ac.cli import main

    for config in ("tiny/dpo", "llama3_2/1B_full_dpo", "llama3_1/8B_full_dpo", "qwen3/0.6B_full_dpo"):
        # The recipe comes from the config's launch comment; the GPU configs' checkpoints are not here (a warning).
        assert main(["validate", "--config", config]) == 0
        assert f"is valid for recipe full_dpo" in capsys.readouterr().out
    assert main(["plan", "--config", "llama3_1/8B_full_dpo", "--nproc", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("setting"))
    assert header.split()[:4] == ["setting", "activations", "parameters", "reference"]
    full = next(line for line in lines if line.startswith("full "))
    parameters, reference = full.split()[2:4]
    assert parameters == reference == "1.87"  # 8.03 B bf16 parameters over 8 processes, the reference's too


def test_a_migrated_full_dpo_distributed_config_validates_for_full_dpo(tmp_path: Path, capsys) -> None:
    import yaml

    from torchtune_ac.cli import main

    checkpointer = {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": "/models/8B",
                    "checkpoint_files": ["model-00001-of-00004.safetensors"], "recipe_checkpoint": None,
                    "output_dir": "/tmp/torchtune/dpo", "model_type": "LLAMA3"}
    torchtune = {
        "output_dir": "/tmp/torchtune/dpo",
        "model": {"_component_": "torchtune.models.llama3_1.llama3_1_8b"},
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                      "path": "/models/8B/original/tokenizer.model", "max_seq_len": 1024},
        "checkpointer": checkpointer, "ref_checkpointer": dict(checkpointer), "resume_from_checkpoint": False,
        "dataset": {"_component_": "torchtune.datasets.stack_exchange_paired_dataset"},
        "seed": None, "shuffle": True, "batch_size": 4,
        "optimizer": {"_component_": "torch.optim.AdamW", "fused": True, "weight_decay": 0.05, "lr": 2e-5},
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": 20},
        "loss": {"_component_": "torchtune.rlhf.loss.DPOLoss", "beta": 0.05, "label_smoothing": 0},
        "epochs": 1, "max_steps_per_epoch": 1000, "gradient_accumulation_steps": 8, "compile": False,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": "/tmp/logs"},
        "log_every_n_steps": 1, "log_peak_memory_stats": True, "device": "cuda", "dtype": "bf16",
        "enable_activation_checkpointing": True, "enable_activation_offloading": False,
    }
    source, out = tmp_path / "8B_full_dpo.yaml", tmp_path / "ours.yaml"
    source.write_text(yaml.safe_dump(torchtune))
    assert main(["migrate", str(source), "-o", str(out)]) == 0
    text = out.read_text()
    assert f"#   tune run full_dpo --config {out}" in text
    assert yaml.safe_load(text)["dpo"] == {"beta": 0.05, "label_smoothing": 0}
    capsys.readouterr()
    assert main(["validate", "--config", str(out)]) == 0  # the recipe read from the launch comment
    assert f"is valid for recipe full_dpo" in capsys.readouterr().out


def test_ref_checkpoint_dir_is_the_reference_and_the_policy_starts_from_checkpoint_dir(tmp_path: Path,
                                                                                        validated_run: Path) -> None:
    trained = final_checkpoint(validated_run)
    check_success(run_tune_in_process(dpo_argv(tmp_path, "max_steps_per_epoch=1", f"ref_checkpoint_dir={trained}")))
    first = read_metrics(tmp_path)[0]
    # The reference prefers the chosen answers already, the starting policy not: the first rewards favour the
    # rejected answers, and the loss is above ln 2.
    assert first["rewards_margin"] < 0 and first["loss"] > math.log(2)
