"""What a resume says of the optimizer and schedule settings that differ from its checkpoint's (this config's are
used): one ``key: saved in step_N, now now`` part per setting, and nothing when nothing changed."""

from __future__ import annotations

import pytest
import torch

from torchtune_ac.run.messages import hyperparameter_changes

ADAMW = {"_component_": "torch.optim.AdamW", "lr": 0.003, "weight_decay": 0.01}
COSINE = {"_component_": "torchtune_ac.training.cosine_schedule_with_warmup", "num_warmup_steps": 8}
SAVED = {"optimizer": ADAMW, "lr_scheduler": COSINE}

CASES = {
    "unchanged": (SAVED, []),
    "learning_rate": ({**SAVED, "optimizer": {**ADAMW, "lr": 1e-05}},
                      ["optimizer.lr: 0.003 in step_0000003, 1e-05 now"]),
    "an_argument_set_now": ({**SAVED, "optimizer": {**ADAMW, "betas": [0.9, 0.95]}},
                            ["optimizer.betas: (default) in step_0000003, [0.9, 0.95] now"]),
    "an_argument_left_to_its_default_now": ({**SAVED, "optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.003}},
                                            ["optimizer.weight_decay: 0.01 in step_0000003, (default) now"]),
    "schedule_keys": ({**SAVED, "lr_scheduler": {**COSINE, "num_warmup_steps": 2, "min_lr_ratio": 0.1}},
                      ["lr_scheduler.min_lr_ratio: (default) in step_0000003, 0.1 now",
                       "lr_scheduler.num_warmup_steps: 8 in step_0000003, 2 now"]),
    "schedule_dropped": ({**SAVED, "lr_scheduler": None},
                         ['lr_scheduler: {"_component_": "torchtune_ac.training.cosine_schedule_with_warmup", '
                          '"num_warmup_steps": 8} in step_0000003, null now']),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_changed_setting_is_one_part_naming_the_checkpoint(name):
    current, expected = CASES[name]
    assert hyperparameter_changes(SAVED, current, "step_0000003") == expected


def test_a_resharded_resume_speaks_of_dropout_masks_only_for_a_model_with_dropout():
    """Every resharded resume warned about dropout masks, a model with no dropout too."""
    from torch import nn

    from torchtune_ac.models import llama_tiny
    from torchtune_ac.run.messages import resharded
    from torchtune_ac.run.phases import uses_dropout

    with torch.device("meta"):
        plain, attention, residual = llama_tiny(), llama_tiny(attn_dropout=0.1), llama_tiny(resid_dropout=0.1)
    assert [uses_dropout(m) for m in (plain, attention, residual)] == [False, True, True]
    assert uses_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0))) is False
    assert uses_dropout(nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.2))) is True
    carried = "resharded from 2 process(es) to 1: model, optimizer, scheduler and data order carry over"
    assert resharded(2, 1, dropout=False) == carried
    assert resharded(2, 1, dropout=True) == carried + "; dropout masks do not (each rank's RNG state is its own)"
