"""The validation loss (dataset_val): every run_val_every_n_steps steps or at each epoch's end, in metrics.jsonl
and the progress line, without changing the training, and the same on 1 and 2 processes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from finetune_runs import check_success, run_tune_in_process, run_tune_subprocess, tune_run_argv

from torchtune_ac.data import EMBEDDED_INSTRUCT_PATH
from torchtune_ac.observability.metrics import read_metrics

# 37 held-out samples: not a multiple of any validation batch below, so the last batch of a pass is completed
# with ignored fillers.
N_VAL = 37


@pytest.fixture(scope="module")
def val_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    lines = Path(EMBEDDED_INSTRUCT_PATH).read_text().splitlines()
    path = tmp_path_factory.mktemp("val") / "val.jsonl"
    path.write_text("\n".join(lines[-N_VAL:]) + "\n")
    return path


def _validation(val_file: Path, *extra: str) -> tuple[str, ...]:
    return ("+dataset_val._component_=torchtune_ac.data.instruct_dataset", f"+dataset_val.source={val_file}",
            "+dataset_val.train_on_input=false", *extra)


def test_validation_loss_is_logged_every_n_steps_and_leaves_training_alone(tmp_path: Path, val_file: Path, caplog):
    caplog.set_level(logging.INFO)
    plain = tmp_path / "plain"
    check_success(run_tune_in_process(tune_run_argv(plain, "max_steps_per_epoch=4")))
    validated = tmp_path / "validated"
    result = run_tune_in_process(tune_run_argv(validated, "max_steps_per_epoch=4",
                                               *_validation(val_file, "run_val_every_n_steps=2", "batch_size_val=5")))
    check_success(result)
    records = read_metrics(validated)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [("val_loss" in r) for r in records] == [False, True, False, True]
    assert 0 < records[3]["val_loss"] < records[1]["val_loss"] < 10
    assert [r["loss"] for r in records] == [r["loss"] for r in read_metrics(plain)]  # no RNG, no gradient touched
    assert f"validation: {N_VAL} samples, every 2 steps" in caplog.text
    assert "| val_loss " in result.stderr


def test_validation_runs_at_each_epochs_end_by_default(tmp_path: Path, val_file: Path):
    out = tmp_path / "run"
    check_success(run_tune_in_process(tune_run_argv(out, "max_steps_per_epoch=2", "epochs=2", *_validation(val_file))))
    assert [r["step"] for r in read_metrics(out) if "val_loss" in r] == [2, 4]


@pytest.mark.distributed
def test_the_validation_loss_is_the_same_on_2_processes_and_1(tmp_path: Path, val_file: Path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ("max_steps_per_epoch=1", "batch_size=4")
    check_success(run_tune_in_process(tune_run_argv(one, *common, *_validation(val_file, "batch_size_val=5"))))
    check_success(run_tune_subprocess(tune_run_argv(two, "max_steps_per_epoch=1", "batch_size=2",
                                                    *_validation(val_file, "batch_size_val=3"), nproc=2)))
    a, b = read_metrics(one)[-1]["val_loss"], read_metrics(two)[-1]["val_loss"]
    # The same 37 samples once each (fillers count nowhere); the weights after one step differ by the order of
    # the gradient reduce (a few float32 ulps), and each micro-batch's float32 sum by its grouping: both move a
    # loss of ~6 by well under 1e-4 relative.
    assert b == pytest.approx(a, rel=1e-4)


def test_an_empty_validation_split_is_named_with_dataset_val(tmp_path: Path, capsys):
    """Was "dd: the dataset holds no records", naming neither the key nor the split (and an IndexError from
    ``datasets`` before, for a saved DatasetDict)."""
    import datasets

    from torchtune_ac.cli import main

    rows = [{"instruction": f"q{i}", "input": "", "output": f"a{i}"} for i in range(8)]
    ds = datasets.Dataset.from_list(rows)
    folder = tmp_path / "dd"
    datasets.DatasetDict(train=ds, validation=ds.select([])).save_to_disk(str(folder))
    data = (f"dataset.source={folder}", "+dataset_val._component_=torchtune_ac.data.instruct_dataset",
            f"+dataset_val.source={folder}", "+dataset_val.split=validation", "batch_size=2")
    expected = f"tune: error: dataset_val: {folder} [validation]: the dataset holds no records\n"
    capsys.readouterr()  # save_to_disk's progress bars
    assert main(["validate", "--config", "tiny/full", f"output_dir={tmp_path / 'out'}", *data]) == 2
    assert capsys.readouterr().err == expected
    result = run_tune_in_process(tune_run_argv(tmp_path / "out", *data))
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, expected.strip())
