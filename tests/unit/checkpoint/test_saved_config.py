"""The config.json a fine-tune saves keeps every field of the input checkpoint's config.json that training did not
change (pad_token_id, initializer_range, use_cache, max_window_layers, ...), field by field, for Llama and Qwen2
checkpoints that transformers wrote; ``tests/integration/test_finetuned_config_fields.py`` does it through ``tune run``.
"""

from __future__ import annotations

import pytest
from hf_families import assert_config_kept, write_custom_config_checkpoint

from torchtune_ac.checkpoint import read_hf_config
from torchtune_ac.models import load_hf, save_hf


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_save_hf_keeps_every_field_of_the_base_config(tmp_path, family):
    base = write_custom_config_checkpoint(family, tmp_path / "base")
    assert base["pad_token_id"] == 5 and base["use_cache"] is False  # what transformers wrote
    save_hf(load_hf(tmp_path / "base"), tmp_path / "out", base_config=base)
    assert_config_kept(base, read_hf_config(tmp_path / "out"))


def test_token_ids_given_replace_the_base_only_where_they_differ(tmp_path):
    base = write_custom_config_checkpoint("llama", tmp_path / "base")
    model = load_hf(tmp_path / "base")
    save_hf(model, tmp_path / "same", base_config=base, bos_token_id=1, eos_token_id=7)  # 7 is one of [2, 7]
    assert_config_kept(base, read_hf_config(tmp_path / "same"))
    save_hf(model, tmp_path / "other", base_config=base, bos_token_id=3, eos_token_id=4)
    saved = read_hf_config(tmp_path / "other")
    assert (saved["bos_token_id"], saved["eos_token_id"], saved["pad_token_id"]) == (3, 4, 5)
    assert_config_kept(base, saved, changed=("bos_token_id", "eos_token_id"))
