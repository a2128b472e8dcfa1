"""``tune run grpo`` / ``lora_grpo`` on the embedded additions: the rollout's metrics and samples are logged, the KL
to the reference is 0 on the first step, SIGTERM saves mid-epoch and the resume redraws the same completions (the
sampler's seed is the step's), ending on the straight run's weights; a mixture of experts adds its load-balancing
loss; the schedule counts optimizer steps, and a resume mid-schedule with two iterations ends as the straight run;
bad input (and the vLLM backend on a CPU) is refused in one line before anything is written; a failing reward stops
the run naming it; compiled decoding draws the eager run's rollout."""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from finetune_runs import check_success, final_checkpoint, load_weights, run_tune_in_process

from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.training.grpo import GRPO_METRICS

# 2 steps an epoch of 2 prompts x 8 completions; the KL term on (its reference the starting weights).
SHORT = ("batch_size=16", "max_steps_per_epoch=2", "grpo.beta=0.04", "samples_every_n_steps=2")
ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/format_match/mean",
                   "rewards/math_answer/std", "completions/mean_length", "completions/min_length",
                   "completions/max_length", "completions/clipped_ratio", "generation_share")


def grpo_argv(output_dir: Path, *overrides: str, recipe: str = "grpo") -> list[str]:
    config = "tiny/grpo" if recipe == "grpo" else "tiny/lora_grpo"
    return ["run", recipe, "--config", config, *SHORT, f"output_dir={output_dir}", *overrides]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 epochs of 2 steps, uninterrupted."""
    output_dir = tmp_path_factory.mktemp("grpo") / "run"
    check_success(run_tune_in_process(grpo_argv(output_dir, "epochs=2")))
    return output_dir


def test_every_step_logs_the_rollout_and_samples_are_written(straight_run: Path) -> None:
    records = read_metrics(straight_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert set(GRPO_METRICS) <= set(record) and set(ROLLOUT_METRICS) <= set(record)
        assert 1 <= record["completions/min_length"] <= record["completions/mean_length"] <= 4
        assert 0.0 < record["generation_share"] < 1.0
    # The policy is its reference before the first update, through the same ops: the k3 estimate is exactly 0.
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0
    samples = [json.loads(line) for line in (straight_run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [2] * 4 + [4] * 4
    first = samples[0]
    assert set(first["rewards"]) == {"format_match", "math_answer"}
    assert first["reward"] == pytest.approx(0.5 * first["rewards"]["format_match"] + first["rewards"]["math_answer"])


@pytest.mark.slow
def test_compiled_decoding_draws_the_straight_runs_first_rollout(straight_run: Path, tmp_path: Path) -> None:
    """generation.compile=true: the first step (the same weights and sampler seed) draws the same completions, so
    its rewards and lengths are the eager run's (the compiled step rounds within 1e-6: no sampled token moves)."""
    from torchtune_ac.generation import decode

    torch._dynamo.reset()
    output_dir = tmp_path / "compiled"
    check_success(run_tune_in_process(grpo_argv(output_dir, "epochs=1", "max_steps_per_epoch=1",
                                                "generation.compile=true")))
    assert decode._COMPILED_DECODE_STEP is not None
    fields = ("reward", "rewards/format_match/mean", "completions/mean_length", "completions/max_length")
    compiled, eager = read_metrics(output_dir)[0], read_metrics(straight_run)[0]
    assert [compiled[f] for f in fields] == [eager[f] for f in fields]



def sigterm_once_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output_dir: Path, *overrides: str
                      ) -> list[str]:
    """A run that sends itself SIGTERM during its first step's scoring (a reward of weight 0 sends it, once)."""
    marker = tmp_path / "send_sigterm"
    (tmp_path / "stopping_reward.py").write_text(
        "import os, signal\n"
        f"MARKER = {str(marker)!r}\n"
        "def sigterm_once(completions, **columns):\n"
        "    if os.path.exists(MARKER):\n"
        "        os.remove(MARKER)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stopping_reward", raising=False)  # an earlier test's, with its own marker
    rewards = ("rewards=[{_component_:torchtune_ac.training.rewards.format_match,pattern:'\\d.*'},"
               "{_component_:torchtune_ac.training.rewards.math_answer},{_component_:stopping_reward.sigterm_once}]",
               "reward_weights=[0.5,1.0,0.0]")
    marker.touch()
    argv = grpo_argv(output_dir, *overrides, *rewards)
    return [argv[0], "--allow-component", "stopping_reward", *argv[1:]]


def check_stopped_then_resumed_as_straight(argv: list[str], output_dir: Path, straight_run: Path,
                                           fields: tuple[str, ...]) -> None:
    """``argv`` stops after its first step with a checkpoint (exit 143); its resume ends as ``straight_run``:
    the same records and final weights, bit-equal (one process replaying the same ops)."""
    stopped = run_tune_in_process(argv)
    assert stopped.returncode == 143 and "Traceback" not in stopped.stderr, stopped.stderr
    assert [r["step"] for r in read_metrics(output_dir)] == [1] and (output_dir / "step_0000001").is_dir()
    check_success(run_tune_in_process([*argv, "resume_from_checkpoint=true"]))
    straight = [[r[f] for f in fields] for r in read_metrics(straight_run)]
    resumed = [[r[f] for f in fields] for r in read_metrics(output_dir)]
    assert resumed == straight
    a, b = load_weights(final_checkpoint(straight_run)), load_weights(final_checkpoint(output_dir))
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_sigterm_mid_epoch_saves_and_the_resume_ends_as_the_straight_run(
        straight_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM during the first step's scoring: the step finishes, is saved mid-epoch, exit 143; the resume redraws
    the remaining steps' completions and ends on the straight run's weights."""
    output_dir = tmp_path / "stopped"
    argv = sigterm_once_argv(tmp_path, monkeypatch, output_dir, "epochs=2")
    check_stopped_then_resumed_as_straight(argv, output_dir, straight_run,
                                           ("loss", "grad_norm", "reward", "kl", "completions/mean_length"))


def test_packed_completions_train_the_first_step_as_one_a_row(straight_run: Path, tmp_path: Path) -> None:
    """grpo.pack_completions through the recipe: the first rollout is the same (same seed, same weights), and its
    loss, KL and gradient norm are the unpacked run's within rounding (the packed rows are other shapes)."""
    output_dir = tmp_path / "packed"
    check_success(run_tune_in_process(grpo_argv(output_dir, "epochs=1", "max_steps_per_epoch=1",
                                                "grpo.pack_completions=true")))
    (packed,), plain = read_metrics(output_dir), read_metrics(straight_run)[0]
    assert (packed["reward"], packed["completions/mean_length"]) == (plain["reward"], plain["completions/mean_length"])
    assert packed["kl"] == 0.0
    for field in ("loss", "grad_norm", "entropy"):
        assert packed[field] == pytest.approx(plain[field], rel=1e-5, abs=1e-7), field


def test_lora_grpo_reference_is_the_base_and_saves_the_adapters(tmp_path: Path) -> None:
    output_dir = tmp_path / "lora"
    check_success(run_tune_in_process(grpo_argv(output_dir, "epochs=1", recipe="lora_grpo")))
    records = read_metrics(output_dir)
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0  # the adapters start at 0: the base is the policy
    assert (final_checkpoint(output_dir) / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("optimizer", ["torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit"])
def test_low_bit_state_trains_the_adapters_alone(optimizer: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """LoRA GRPO with the KL term (the reference is the base, adapters off) and torchao's low-bit AdamW trains, and
    only the adapters have optimizer state (rank 32: 4,096 entries a matrix, the size torchao quantizes from)."""
    pytest.importorskip("torchao")
    # torchao's update traced but run eagerly: the same ops, without inductor's code for each shape (a minute).
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    output_dir = tmp_path / "low_bit"
    check_success(run_tune_in_process(grpo_argv(
        output_dir, "epochs=1", f"optimizer._component_={optimizer}", "adapter.rank=32", "adapter.targets=[q_proj]",
        recipe="lora_grpo")))
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in read_metrics(output_dir))
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(final_checkpoint(output_dir) / "recipe_state").read_metadata().state_dict_metadata
    with_state = {key.removeprefix("optimizer.state.").rsplit(".", 1)[0] for key in stored
                  if key.startswith("optimizer.state.")}
    assert with_state == {f"layers.{i}.attn.q_proj.lora_{ab}.weight" for i in range(8) for ab in "ab"}


@pytest.mark.parametrize("override, message", [
    ("grpo.num_generations=1", "grpo.num_generations=1: must be >= 2"),
    ("batch_size=12", "batch_size=12: must be a multiple of grpo.num_generations=8"),
    ("grpo.epsilon=-0.1", "grpo.epsilon=-0.1: must be >= 0.0"),
    ("grpo.loss_type=foo", "grpo.loss_type='foo': expected one of grpo, bnpo, dr_grpo, dapo"),
    ("max_seq_len=4000", "past the model's 512 positions"),
    ("generation.max_new_tokens=600", "generation.max_new_tokens=600: must be less than max_seq_len=16"),
    ("rewards=[{_component_:os.system}]", "rewards[0]._component_=os.system: not allowed"),
    ("rewards=[{_component_:torchtune_ac.training.rewards.nothing}]", "rewards[0]"),
])
def test_bad_grpo_input_is_one_line_and_nothing_is_written(override: str, message: str, tmp_path: Path) -> None:
    result = run_tune_in_process(grpo_argv(tmp_path / "out", override, "reward_weights=null"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr.strip().splitlines()[-1], result.stderr
    assert not (tmp_path / "out").exists()


def test_a_dataset_without_the_answer_a_reward_needs_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1="}) + "\n" for i in range(16)))
    result = run_tune_in_process(grpo_argv(tmp_path / "out", f"dataset.source={data}"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "math_answer needs answer, which the dataset does not have" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def test_a_users_reward_runs_only_when_allowed_and_a_nan_stops_the_run_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text("def bad(completions, **columns):\n"
                                            "    return [float('nan')] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reward = ("rewards=[{_component_:my_rewards.bad}]", "reward_weights=null")
    refused = run_tune_in_process(grpo_argv(tmp_path / "a", *reward))
    assert refused.returncode == 2 and "--allow-component my_rewards.bad" in refused.stderr, refused.stderr
    argv = grpo_argv(tmp_path / "b", *reward)
    result = run_tune_in_process([argv[0], "--allow-component", "my_rewards", *argv[1:]])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("reward bad returned nan for completion 0: scores must "
                                                           "be finite")
    assert not list((tmp_path / "b").glob("step_*"))


def test_grpo_trains_a_mixture_of_experts_with_its_load_balancing_loss(tmp_path: Path) -> None:
    """The tiny Qwen3-MoE: the load-balancing term is added to the GRPO loss and both are logged; the experts' token
    counts are the loss passes' (two iterations), not the decoding's or the old log-probabilities' forwards."""
    output_dir = tmp_path / "moe"
    check_success(run_tune_in_process(grpo_argv(
        output_dir, "epochs=1", "grpo.num_iterations=2", "model._component_=torchtune_ac.models.qwen3_moe_tiny",
        "checkpoint_dir=null", "tokenizer.path=${embedded_checkpoint:}")))
    records = read_metrics(output_dir)
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["loss"] == pytest.approx(record["grpo_loss"] + record["moe_aux_term"], rel=1e-6, abs=1e-7)
        assert record["moe_aux_term"] == pytest.approx(0.01 * record["moe_aux_loss"], rel=1e-5)
        # Dropless, 2 experts a token: each sparse layer counted every token of both loss passes twice.
        assert [sum(layer) for layer in record["moe_expert_tokens"]] == [2 * record["tokens"]] * 3


# 2 rollouts of 2 iterations with a warm-up of 2 optimizer steps.
SCHEDULED = ("epochs=1", "grpo.num_iterations=2", "optimizer.lr=3e-3",
             "lr_scheduler={_component_:torchtune_ac.training.cosine_schedule_with_warmup,num_warmup_steps:2}")


@pytest.fixture(scope="module")
def scheduled_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    output_dir = tmp_path_factory.mktemp("grpo_lr") / "run"
    check_success(run_tune_in_process(grpo_argv(output_dir, *SCHEDULED)))
    return output_dir


def test_the_schedule_steps_once_per_optimizer_step_as_trls(scheduled_run: Path) -> None:
    """2 rollouts of 2 iterations: 4 optimizer steps, the first 2 warming up (TRL counts both in optimizer steps).
    Each record's lr is its last optimizer step's: factors 2/3 (warm-up) and 1/2 (cosine, half way)."""
    assert [r["lr"] for r in read_metrics(scheduled_run)] == pytest.approx([2e-3, 1.5e-3], rel=1e-6)


def test_a_resume_mid_schedule_with_two_iterations_ends_as_the_straight_run(
        scheduled_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stopped after the first rollout (2 optimizer steps, the warm-up's), the resume continues the schedule and
    the rollouts: the second step's lr, old log-probabilities' ratios and weights are the straight run's."""
    output_dir = tmp_path / "stopped"
    argv = sigterm_once_argv(tmp_path, monkeypatch, output_dir, *SCHEDULED)
    check_stopped_then_resumed_as_straight(argv, output_dir, scheduled_run,
                                           ("loss", "grad_norm", "lr", "reward", "clip_ratio_region", "entropy",
                                            "completions/mean_length"))


def test_the_vllm_backend_is_refused_before_anything_is_written(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With a vllm package importable (a stand-in here), a CPU run is refused by the set-up, before any weight
    loads: one line, exit 2, no output directory (the glue itself: tests/unit/generation/test_vllm_backend.py)."""
    import types

    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    result = run_tune_in_process(grpo_argv(tmp_path / "out", "generation.backend=vllm"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(
        "generation.backend=vllm: needs a CUDA device (this run is on cpu); use native"), result.stderr
    assert not (tmp_path / "out").exists()
