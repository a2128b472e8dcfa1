"""What the run's length makes worth a warning: a warm-up the run ends inside (the learning rate never reaches the
optimizer's: a 3-step run with 100 warm-up steps ended at 3 % of it, without a word), and the samples each epoch
leaves out when the global batch does not divide them (4 of 20, silently)."""

from __future__ import annotations

import pytest

from torchtune_ac.run.messages import length_warnings
from torchtune_ac.run.length import RunLength
from torchtune_ac.runtime.parallelism import Parallelism

ADAMW = {"_component_": "torch.optim.AdamW", "lr": 0.003}
HYPER = {"optimizer": ADAMW,
         "lr_scheduler": {"_component_": "torchtune_ac.training.cosine_schedule_with_warmup", "num_warmup_steps": 8}}
CONSTANT = {"optimizer": ADAMW, "lr_scheduler": {"_component_": "torchtune_ac.training.constant_schedule"}}
NO_SCHEDULE = {"optimizer": ADAMW, "lr_scheduler": None}
WARMUP = ("lr_scheduler.num_warmup_steps=8: the run has {} step(s), so it ends still warming up and the learning "
          "rate never reaches optimizer.lr=0.003; lower num_warmup_steps (or train longer)")
LEFT_OUT = ("dataset: 4 samples of 20 not trained on in each epoch: the global batch of 8 does not divide them, and "
            "the last, incomplete batch is left out; a global batch that divides 20 uses every sample")


def length(*, world_size=1, batch_size=4, accumulation=1, epochs=1, cap=None, samples=None, tp=1,
           iterations=1) -> RunLength:
    planned = RunLength(Parallelism(world_size, tensor=tp), batch_size, accumulation, epochs, cap,
                        optimizer_steps_per_step=iterations)
    if samples is None:  # tune validate: the data not read
        return planned
    # the loader drops the last incomplete batch; tune validate (no world size) counts as on one process
    return planned.counted(samples, samples // (batch_size * (world_size // tp if world_size else 1)))


CASES = {
    "validate_capped_inside_the_warmup": (length(world_size=None, cap=4, epochs=2), HYPER,
                                          [WARMUP.format("at most 8")]),
    "validate_capped_past_the_warmup": (length(world_size=None, cap=9), HYPER, []),
    "validate_uncapped": (length(world_size=None), HYPER, []),
    "validate_counted_from_the_data": (length(world_size=None, samples=32), HYPER, [WARMUP.format("at most 8")]),
    "validate_counted_past_the_warmup": (length(world_size=None, samples=36), HYPER, []),
    "run_inside_the_warmup": (length(samples=32), HYPER, [WARMUP.format(8)]),
    "run_past_the_warmup": (length(samples=36), HYPER, []),
    "run_inside_the_warmup_and_samples_left_out": (length(world_size=2, samples=20), HYPER,
                                                   [WARMUP.format(2), LEFT_OUT]),
    # GRPO's num_iterations optimizer steps a rollout: the warm-up counts optimizer steps.
    "grpo_inside_the_warmup": (length(samples=16, iterations=2), HYPER,
                               [WARMUP.format("8 optimizer").replace("step(s),", "step(s) (2 a step),")]),
    "grpo_past_the_warmup": (length(samples=20, iterations=2), HYPER, []),
    "no_warmup_to_finish": (length(samples=4), CONSTANT, []),
    "no_schedule": (length(samples=4), NO_SCHEDULE, []),
    "samples_left_out": (length(world_size=2, samples=20), NO_SCHEDULE, [LEFT_OUT]),
    "by_accumulation": (length(world_size=2, batch_size=2, accumulation=2, samples=20), NO_SCHEDULE, [LEFT_OUT]),
    "by_tensor_parallel_groups": (length(world_size=4, tp=2, samples=20), NO_SCHEDULE, [LEFT_OUT]),
    "cap_reached_before_the_end_of_the_data": (length(world_size=2, cap=1, samples=20), NO_SCHEDULE, []),
    "cap_at_the_end_of_the_data": (length(world_size=2, cap=2, samples=20), NO_SCHEDULE, [LEFT_OUT]),
    "global_batch_divides": (length(world_size=2, samples=24), NO_SCHEDULE, []),
}


@pytest.mark.parametrize("name", CASES)
def test_length_warnings(name):
    run_length, hyperparameters, expected = CASES[name]
    assert length_warnings(run_length, hyperparameters) == expected
