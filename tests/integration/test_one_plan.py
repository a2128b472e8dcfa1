"""``tune validate``, ``tune plan`` and ``tune run`` resolve the same run plan and print it alike, each building the
model on the meta device once and the tokenizer once (a run: once per process)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from finetune_runs import check_success, run_tune_in_process, tune_run_argv

from torchtune_ac.cli import main
from torchtune_ac.config.components import Component

# The plan's lines that do not depend on the world size or on reading the data.
COMMON = ("model", "activation checkpointing", "optimizer state", "optimizer step", "loss", "activation offloading",
          "CPU offload", "dtype / device", "batch", "save", "checkpoint_dir")


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many times the model is built on the meta device and the tokenizer built, in this process."""
    counted = {"meta model": 0, "tokenizer": 0}
    real_defaults, real_instantiate = Component.instantiate_with_defaults, Component.instantiate

    def instantiate_with_defaults(self, *args, **kwargs):
        if self.key == "model" and torch.empty(0).device.type == "meta":
            counted["meta model"] += 1
        return real_defaults(self, *args, **kwargs)

    def instantiate(self, *args, **kwargs):
        if self.key == "tokenizer":
            counted["tokenizer"] += 1
        return real_instantiate(self, *args, **kwargs)

    monkeypatch.setattr(Component, "instantiate_with_defaults", instantiate_with_defaults)
    monkeypatch.setattr(Component, "instantiate", instantiate)
    return counted


def _lines(text: str, separator: str) -> dict[str, str]:
    """label -> value of the lines ``label<separator>value`` among ``text``'s, for the plan's labels."""
    found = {}
    for line in text.splitlines():
        for label in COMMON:
            if line.strip().startswith(label + separator):
                found.setdefault(label, line.strip()[len(label + separator):].strip())
    return found


def test_validate_plan_and_run_print_the_same_plan_from_one_meta_build(tmp_path: Path, capsys, caplog, builds):
    overrides = ["max_seq_len=64", "batch_size=4", f"output_dir={tmp_path / 'run'}", "ac_mode=selective",
                 "ac_option=2"]
    assert main(["validate", "--config", "tiny/full", *overrides]) == 0
    validated = _lines(capsys.readouterr().out, "  ")
    assert builds == {"meta model": 1, "tokenizer": 1}

    assert main(["plan", "--config", "tiny/full", *overrides]) == 0
    planned = _lines(capsys.readouterr().out, "  ")
    assert builds == {"meta model": 2, "tokenizer": 1}  # tune plan reads no tokenizer

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="torchtune_ac"):
        check_success(run_tune_in_process(tune_run_argv(tmp_path / "run", *overrides, "max_steps_per_epoch=2")))
    ran = _lines("\n".join(record.getMessage() for record in caplog.records), ": ")
    assert builds == {"meta model": 3, "tokenizer": 2}  # the run: one of each

    assert sorted(validated) == sorted(COMMON)
    assert validated == planned == ran
    assert validated["activation checkpointing"] == "selective every 2nd block: 4 of 8 blocks [1, 3, 5, 7]"
