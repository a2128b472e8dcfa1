"""Mistakes in user input end ``tune run full_finetune`` with exit status 2 and one short line naming the
problem, never a traceback, and never cost a file: the whole test directory (inputs and output_dir) is
byte-for-byte the same afterwards."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from finetune_runs import (
    check_success,
    hash_tree,
    run_tune_in_process,
    run_tune_subprocess,
    tune_run_argv,
)


@dataclass(frozen=True)
class Inputs:
    """Files the cases point the config at, all under ``root``."""

    root: Path
    output_dir: Path
    embedded: Path

    @property
    def data(self) -> Path:
        return self.root / "data"


@dataclass(frozen=True)
class BadInput:
    overrides: Callable[[Inputs], list[str]]
    message: tuple[str, ...]  # each must appear in the error line
    earlier_run: bool = False  # output_dir holds a finished 5-step run (else only an unrelated notes.txt)


def _four_layer_model(inputs: Inputs) -> list[str]:
    return [
        "model._component_=torchtune_ac.models.llama_from_hf_config",
        f"+model.config={inputs.data / 'four_layers'}",
        "checkpoint_dir=null",
        f"tokenizer.path={inputs.embedded}",
    ]


CASES = {
    "dataset_missing": BadInput(
        lambda i: [f"dataset.source={i.data / 'missing.jsonl'}"], ("dataset source", "missing.jsonl", "does not exist")
    ),
    "malformed_json_line": BadInput(
        lambda i: [f"dataset.source={i.data / 'malformed.jsonl'}"], ("malformed.jsonl:3:", "invalid JSON")
    ),
    "missing_column": BadInput(
        lambda i: [f"dataset.source={i.data / 'no_output.jsonl'}"], ("no_output.jsonl:1:", "missing column 'output'")
    ),
    "empty_dataset": BadInput(lambda i: [f"dataset.source={i.data / 'empty.jsonl'}"], ("empty.jsonl", "no records")),
    "max_seq_len_zero": BadInput(lambda i: ["max_seq_len=0"], ("max_seq_len=0", "must be >= 1")),
    "batch_size_zero": BadInput(lambda i: ["batch_size=0"], ("batch_size=0", "must be >= 1")),
    # torch.manual_seed takes 64 bits at most (was an OverflowError traceback, exit 1, after validation passed).
    "seed_beyond_64_bits": BadInput(lambda i: ["seed=99999999999999999999"], ("seed=99999999999999999999", "must be <=")),
    "output_dir_under_a_file": BadInput(
        lambda i: [f"output_dir={i.data / 'a_file' / 'run'}"], ("output_dir", "a_file", "not writable")
    ),
    # Refused after the lock was taken: output_dir's missing parents go with it (a/b were left for a/b/c).
    "output_dir_with_missing_parents": BadInput(
        lambda i: [f"output_dir={i.root / 'a' / 'b' / 'c'}", f"dataset.source={i.data / 'no_output.jsonl'}"],
        ("no_output.jsonl:1:", "missing column 'output'"),
    ),
    "output_dir_under_an_executable_file": BadInput(
        lambda i: [f"output_dir={i.data / 'a_script' / 'run'}"], ("output_dir", "a_script", "not a directory")
    ),
    "checkpoint_dir_without_weights": BadInput(
        lambda i: [f"checkpoint_dir={i.data / 'config_only'}", f"tokenizer.path={i.embedded}"],
        ("config_only", "no weights", "model.safetensors"),
    ),
    # An allowed model of no known family cannot take a Hugging Face checkpoint (was an AttributeError, exit 1).
    "custom_model_with_checkpoint_dir": BadInput(
        lambda i: [
            "model._component_=torch.nn.TransformerEncoder",
            "+model.encoder_layer._component_=torch.nn.TransformerEncoderLayer",
            "+model.encoder_layer.d_model=8",
            "+model.encoder_layer.nhead=2",
            "+model.num_layers=2",
        ],
        ("checkpoint_dir", "known family (llama", "TransformerEncoder is not one of them"),
    ),
    "resume_with_other_model_shape": BadInput(
        lambda i: ["resume_from_checkpoint=true", *_four_layer_model(i)],
        ("step_0000005", "cannot continue exactly", "num_hidden_layers 8 -> 4"),
        earlier_run=True,
    ),
    "resume_with_other_batch_size": BadInput(
        lambda i: ["resume_from_checkpoint=true", "batch_size=2"], ("batch_size was 4, now 2",), earlier_run=True
    ),
    "resume_with_other_data": BadInput(
        lambda i: ["resume_from_checkpoint=true", "seed=7", "dataset.train_on_input=true"],
        ("cannot continue exactly", "seed was 0, now 7", '"train_on_input": true'),
        earlier_run=True,
    ),
    # Its hyper-parameters may change on resume (the config's are used), not its class: the state is AdamW's.
    "resume_with_another_optimizer": BadInput(
        lambda i: ["resume_from_checkpoint=true", "optimizer._component_=torch.optim.SGD"],
        ('optimizer._component_ was "torch.optim.AdamW", now "torch.optim.SGD"', "checkpoint_dir="),
        earlier_run=True,
    ),
    # The earlier run finished its one epoch after 5 steps; a longer epoch was "nothing to do", exit 0.
    "resume_with_more_steps_per_epoch": BadInput(
        lambda i: ["resume_from_checkpoint=true", "max_steps_per_epoch=8"],
        ("step_0000005", "finished its 1 epoch(s) at step 5", "8 steps per epoch", "raise epochs"),
        earlier_run=True,
    ),
    # A step_* folder the run did not write: the resume started at step 0 and deleted it at its first save.
    "resume_in_output_dir_with_a_foreign_step_folder": BadInput(
        lambda i: [f"output_dir={i.data / 'foreign_run'}", "resume_from_checkpoint=true"],
        ("step_0000009 has no recipe state", "would replace or delete it"),
    ),
    "fresh_run_in_earlier_output_dir": BadInput(
        lambda i: [], ("output_dir", "earlier run", "resume_from_checkpoint=true"), earlier_run=True
    ),
}


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 5-step run (checkpoint step_0000005 with recipe state, metrics.jsonl)."""
    output_dir = tmp_path_factory.mktemp("errors") / "earlier"
    check_success(run_tune_in_process(tune_run_argv(output_dir)))
    return output_dir


def _prepare(tmp_path: Path, case: BadInput, earlier_run: Path, embedded: Path) -> Inputs:
    inputs = Inputs(tmp_path, tmp_path / "out", embedded)
    if case.earlier_run:
        shutil.copytree(earlier_run, inputs.output_dir)
    else:
        inputs.output_dir.mkdir()
        (inputs.output_dir / "notes.txt").write_text("not a run; must survive\n")
    data = inputs.data
    data.mkdir()
    good = json.dumps({"instruction": "Say hi.", "output": "hi"})
    (data / "malformed.jsonl").write_text(f"{good}\n{good}\n{{\"instruction\": \"x\", oops}}\n{good}\n")
    (data / "no_output.jsonl").write_text(json.dumps({"instruction": "Say hi.", "answer": "hi"}) + "\n")
    (data / "empty.jsonl").write_text("")
    (data / "a_file").write_text("a regular file\n")
    (data / "foreign_run" / "step_0000009").mkdir(parents=True)
    (data / "foreign_run" / "step_0000009" / "notes.txt").write_text("not a checkpoint; must survive\n")
    (data / "a_script").write_text("#!/bin/sh\n")
    (data / "a_script").chmod(0o755)  # os.access(W_OK | X_OK) alone would let it pass as a directory
    (data / "config_only").mkdir()
    shutil.copy(embedded / "config.json", data / "config_only")
    hf_config = json.loads((embedded / "config.json").read_text())
    (data / "four_layers").mkdir()
    (data / "four_layers" / "config.json").write_text(json.dumps({**hf_config, "num_hidden_layers": 4}))
    return inputs


def _argv(inputs: Inputs, case: BadInput, nproc: int = 1) -> list[str]:
    return tune_run_argv(inputs.output_dir, *case.overrides(inputs), nproc=nproc)


def _assert_short_error(stderr: str, message: tuple[str, ...]) -> None:
    lines = stderr.strip().splitlines()
    assert "Traceback" not in stderr, stderr
    assert 1 <= len(lines) <= 2 and lines[0].startswith("tune: error: "), stderr
    for part in message:
        assert part in lines[0], (part, stderr)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_one_line(name: str, tmp_path: Path, earlier_run: Path,
                                         embedded_checkpoint: Path) -> None:
    case = CASES[name]
    inputs = _prepare(tmp_path, case, earlier_run, embedded_checkpoint)
    before = hash_tree(tmp_path)
    result = run_tune_in_process(_argv(inputs, case))
    assert result.returncode == 2, result.stderr
    _assert_short_error(result.stderr, case.message)
    assert hash_tree(tmp_path) == before


@pytest.mark.skipif(
    os.geteuid() == 0, reason="root may write into a 0o500 directory (output_dir_under_a_file covers root)"
)
def test_read_only_output_dir_exits_2(tmp_path: Path) -> None:
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        result = run_tune_in_process(tune_run_argv(parent / "run"))
        assert result.returncode == 2, result.stderr
        _assert_short_error(result.stderr, ("output_dir", "not writable"))
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o700)


@pytest.mark.parametrize("name", ["malformed_json_line", "resume_with_other_model_shape"])
def test_tune_command_exits_2_without_traceback(name: str, tmp_path: Path, earlier_run: Path,
                                                embedded_checkpoint: Path) -> None:
    """The same through a real ``tune`` process: its exit status and everything it prints."""
    case = CASES[name]
    inputs = _prepare(tmp_path, case, earlier_run, embedded_checkpoint)
    before = hash_tree(tmp_path)
    result = run_tune_subprocess(_argv(inputs, case))
    assert result.returncode == 2, result.stderr
    _assert_short_error(result.stderr, case.message)
    assert hash_tree(tmp_path) == before


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    [
        "fresh_run_in_earlier_output_dir",  # refused by the launcher's own checks, before any worker starts
        "malformed_json_line",  # refused inside every worker
    ],
)
def test_launcher_exits_2_without_traceback(name: str, tmp_path: Path, earlier_run: Path,
                                            embedded_checkpoint: Path) -> None:
    case = CASES[name]
    inputs = _prepare(tmp_path, case, earlier_run, embedded_checkpoint)
    before = hash_tree(tmp_path)
    result = run_tune_subprocess(_argv(inputs, case, nproc=2))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    # One line, once: not once per rank, and none of the elastic launcher's lines about ending the workers.
    ours = [line for line in result.stderr.splitlines() if line.startswith("tune: error: ")]
    assert len(ours) == 1 and all(part in ours[0] for part in case.message), result.stderr
    assert "[rank" not in result.stderr and "closing signal" not in result.stderr, result.stderr
    assert "exitcode" not in result.stderr, result.stderr
    assert hash_tree(tmp_path) == before
