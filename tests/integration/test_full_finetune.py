"""``tune run full_finetune --config tiny/full`` in one process: it learns, logs every step, writes Hugging Face
checkpoints that transformers loads, leaves the base checkpoint alone, and activation checkpointing changes
nothing about the numbers."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from finetune_runs import (
    DROPOUT,
    check_success,
    final_checkpoint,
    hash_tree,
    load_weights,
    read_losses,
    run_tune_in_process,
    tune_run_argv,
)
from numerics import assert_close, llama_terms

from torchtune_ac.checkpoint import list_checkpoints
from torchtune_ac.models import load_hf
from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.run import plan as planning

LEARNING_STEPS = 30
PEAK_LR = 3.0e-3  # configs/tiny/full.yaml
WARMUP_STEPS = 8


@dataclass(frozen=True)
class LearningRun:
    output_dir: Path
    base_before: dict[str, str]
    base_after: dict[str, str]


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory: pytest.TempPathFactory, embedded_checkpoint: Path) -> LearningRun:
    """One 30-step run of tiny/full (started from the embedded checkpoint), shared by the tests below."""
    output_dir = tmp_path_factory.mktemp("learning") / "run"
    base_before = hash_tree(embedded_checkpoint)
    check_success(run_tune_in_process(tune_run_argv(output_dir, f"max_steps_per_epoch={LEARNING_STEPS}")))
    return LearningRun(output_dir, base_before, hash_tree(embedded_checkpoint))


def test_loss_falls(learning_run: LearningRun) -> None:
    losses = read_losses(learning_run.output_dir)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # The embedded model starts near ln(vocab_size=512) ~ 6.2; 30 steps of this config reach well below 5.
    assert last < first - 1.0, f"mean loss of the first 5 steps {first:.3f}, of the last 5 {last:.3f}"


def test_metrics_has_one_sane_record_per_step(learning_run: LearningRun) -> None:
    records = read_metrics(learning_run.output_dir)
    assert [r["step"] for r in records] == list(range(1, LEARNING_STEPS + 1))
    for r in records:
        assert r["epoch"] == 0
        assert math.isfinite(r["loss"]) and 0 < r["loss"] < 10, r
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        assert 0 < r["lr"] <= PEAK_LR, r
        assert math.isfinite(r["tokens_per_second"]) and r["tokens_per_second"] > 0, r
        # CPU runs report peak resident memory: more than the 6 MB model, far less than the machine.
        assert 0.01 < r["peak_memory_gib"] < 64, r
        assert 0 < r["target_tokens"] < r["tokens"] <= 4 * 64, r  # batch_size x max_seq_len
        assert r["step_time_s"] > 0, r
        # The rate of target tokens: padding and masked prompts excluded.
        assert r["target_tokens_per_second"] == pytest.approx(r["target_tokens"] / r["step_time_s"]), r
        assert r["target_tokens_per_second"] < r["tokens_per_second"], r


def test_logged_lr_follows_the_warmup_then_decays(learning_run: LearningRun) -> None:
    lrs = [r["lr"] for r in read_metrics(learning_run.output_dir)]
    # The lr logged for step t is the one that step used: linear warm-up, the peak, then cosine decay.
    assert lrs[0] == pytest.approx(PEAK_LR / (WARMUP_STEPS + 1))
    assert lrs[WARMUP_STEPS] == pytest.approx(PEAK_LR)
    assert all(a > b for a, b in zip(lrs[WARMUP_STEPS:], lrs[WARMUP_STEPS + 1:]))


def test_only_the_epoch_end_is_saved_with_recipe_state(learning_run: LearningRun) -> None:
    checkpoints = list_checkpoints(learning_run.output_dir)
    assert [c.name for c in checkpoints] == [f"step_{LEARNING_STEPS:07d}"]
    assert (checkpoints[0] / "recipe_state" / "trainer_state.json").is_file()


def test_checkpoint_loads_in_transformers_with_the_same_logits(
    learning_run: LearningRun, embedded_checkpoint: Path
) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint = final_checkpoint(learning_run.output_dir)
    ours = load_hf(checkpoint).eval()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    base = load_hf(embedded_checkpoint).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(tokens).logits
        before = base(tokens)
    # transformers adds in other orders (other attention kernels, RoPE and norm formulas): within rounding.
    assert_close(got, expected, terms=llama_terms(ours.args, 24, 0, backward=False), what="logits")
    # The fine-tuned weights really were saved (not the base model's).
    assert (expected - before).abs().max().item() > 1e-2


def test_checkpoint_carries_the_tokenizer(learning_run: LearningRun, embedded_checkpoint: Path) -> None:
    checkpoint = final_checkpoint(learning_run.output_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (checkpoint / name).read_bytes() == (embedded_checkpoint / name).read_bytes(), name


def test_base_checkpoint_is_unchanged(learning_run: LearningRun) -> None:
    assert "model.safetensors" in learning_run.base_before
    assert learning_run.base_after == learning_run.base_before


# ------------------------------------------------------------------------------ activation checkpointing

AC_STEPS = 6
# name -> overrides; each run has dropout on, so the recomputed forward must replay the same masks.
AC_MODES = {
    "full": ("enable_activation_checkpointing=true", "ac_mode=full"),
    "selective_every_2nd_block": ("ac_mode=selective", "ac_option=2"),
    "selective_per_op": ("ac_mode=selective", "ac_option=op"),
    # 40 MiB per process: per-op AC is the least recompute that fits (tune plan: none needs 49, per-op 35).
    "auto": ("enable_activation_checkpointing=null", "ac_mode=auto", "ac_memory_budget_gib=0.0390625"),
}
AC_PLAN_LINES = {
    "none": "activation checkpointing: none",
    "full": "activation checkpointing: full: all 8 blocks",
    "selective_every_2nd_block": "activation checkpointing: selective every 2nd block: 4 of 8 blocks",
    "selective_per_op": "activation checkpointing: selective per-op",
    "auto": "activation checkpointing: auto -> selective per-op (save matmuls and attention, recompute the rest): "
            "all 8 blocks (the least recompute that fits: estimated 0.03 GiB of 0.0390625 GiB per process, 0.00 of them "
            "the process's own)",
}


def _run_ac(output_dir: Path, overrides: tuple[str, ...], caplog: pytest.LogCaptureFixture) -> str:
    """Run AC_STEPS steps and return the recipe's log (which names the AC plan it applied)."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchtune_ac"):
        check_success(run_tune_in_process(tune_run_argv(output_dir, f"max_steps_per_epoch={AC_STEPS}", *overrides)))
    return caplog.text


@pytest.fixture(scope="module")
def no_ac_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("ac") / "none"
    check_success(run_tune_in_process(
        tune_run_argv(output_dir, f"max_steps_per_epoch={AC_STEPS}", "enable_activation_checkpointing=false", *DROPOUT)
    ))
    assert len(read_losses(output_dir)) == AC_STEPS
    return output_dir


def test_no_ac_run_applies_no_plan_and_dropout_changes_the_loss(
    tmp_path: Path, no_ac_run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = _run_ac(tmp_path / "no_dropout", ("enable_activation_checkpointing=false",), caplog)
    assert AC_PLAN_LINES["none"] in log
    # Without this difference the equality test below could not tell whether dropout was on at all.
    with_dropout, without = read_losses(no_ac_run), read_losses(tmp_path / "no_dropout")
    assert all(a != b for a, b in zip(with_dropout, without))


@pytest.mark.parametrize("mode", sorted(AC_MODES))
def test_activation_checkpointing_gives_identical_losses_and_weights(
    mode: str, tmp_path: Path, no_ac_run: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "auto":
        # The budget is the step's (40 MiB); the process's fixed cost, which ``ac_mode: auto`` adds, would be this
        # pytest process's resident set (the run is in-process), which grows with what the session ran before.
        # The fixed cost is tested on its own (tests/unit/runtime/test_process_memory.py, the planner's tests).
        monkeypatch.setattr(planning, "process_fixed_bytes", lambda device: (0, "none"))
    log = _run_ac(tmp_path / mode, (*AC_MODES[mode], *DROPOUT), caplog)
    assert AC_PLAN_LINES[mode] in log
    # Bit for bit: one process, the same ops replayed in the same order (the recompute only repeats them).
    assert read_losses(tmp_path / mode) == read_losses(no_ac_run)
    ours, reference = load_weights(final_checkpoint(tmp_path / mode)), load_weights(final_checkpoint(no_ac_run))
    assert all(torch.equal(ours[name], reference[name]) for name in reference)
