"""A fine-tune's saved config.json keeps every field of its base checkpoint's config.json that training did not
change, for Llama and Qwen2 checkpoints that transformers wrote (the report: ``pad_token_id`` became null on every
run, ``initializer_range``, ``use_cache`` and ``max_window_layers`` were dropped)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from finetune_runs import check_success, run_tune_in_process, tune_run_argv
from hf_families import assert_config_kept, write_custom_config_checkpoint

from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, load_tokenizer


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_fine_tune_keeps_every_field_of_its_checkpoints_config(tmp_path, family):
    base_dir = tmp_path / "base"
    base = write_custom_config_checkpoint(family, base_dir, vocab_size=512)  # the embedded tokenizer's 512 tokens
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(EMBEDDED_TOKENIZER_DIR) / name, base_dir / name)
    tokenizer = load_tokenizer(str(base_dir))
    out = tmp_path / "out"
    check_success(run_tune_in_process(tune_run_argv(
        out, f"checkpoint_dir={base_dir}", "model._component_=torchtune_ac.models.from_hf_config",
        "max_steps_per_epoch=2")))
    saved = json.loads((out / "step_0000002" / "config.json").read_text())
    # The tokenizer the run trained with decides the special ids it learned to emit.
    assert saved["bos_token_id"] == tokenizer.bos_id and saved["eos_token_id"] == tokenizer.eos_id
    assert_config_kept(base, saved, changed=("bos_token_id", "eos_token_id"))
