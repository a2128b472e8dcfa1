"""``tune run full_dpo --config tiny/vlm_dpo`` and ``lora_dpo --config tiny/vlm_lora_dpo``: DPO of a tiny random
Qwen2.5-VL on the embedded image preference pairs. Step 1's reference is the policy (full: the starting weights;
LoRA: the base with its adapters off), so every pair's loss is ln 2 and the rewards are 0; step 2's rewards are not.
Parity with TRL's DPOTrainer on image pairs: tests/unit/training/test_vision_dpo_trl_parity.py."""

from __future__ import annotations

import math

import pytest
from finetune_runs import check_success, final_checkpoint, run_tune_in_process
from numerics import assert_close
from safetensors.torch import load_file

from torchtune_ac.checkpoint.peft import ADAPTER_WEIGHTS_FILE
from torchtune_ac.observability.metrics import read_metrics

PAIRS_PER_STEP = 4
CONFIGS = {"full_dpo": "tiny/vlm_dpo", "lora_dpo": "tiny/vlm_lora_dpo"}


@pytest.mark.parametrize("recipe", sorted(CONFIGS))
def test_image_pairs_start_at_ln2_and_move(recipe, tmp_path):
    command = ["run", recipe, "--config", CONFIGS[recipe], f"batch_size={PAIRS_PER_STEP}", "max_steps_per_epoch=2",
               f"output_dir={tmp_path}"]
    check_success(run_tune_in_process(command))
    first, second = read_metrics(tmp_path)
    # The reference runs the same ops on the same rows and images: every log-ratio is 0, each pair's loss is
    # float32(ln 2), and their mean rounds PAIRS_PER_STEP additions.
    assert_close(first["loss"], math.log(2), terms=PAIRS_PER_STEP, what="the first loss")
    assert first["rewards_chosen"] == first["rewards_rejected"] == 0.0
    assert second["rewards_margin"] != 0.0
    if recipe == "lora_dpo":
        names = list(load_file(final_checkpoint(tmp_path) / ADAPTER_WEIGHTS_FILE))
        assert names and all(".language_model." in name for name in names)
