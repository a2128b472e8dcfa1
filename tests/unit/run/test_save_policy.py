"""When a run saves, and how many checkpoints it will write from a step on (what the free-space check counts)."""

from __future__ import annotations

import pytest

from torchtune_ac.runtime.parallelism import Parallelism
from torchtune_ac.run.length import RunLength, SavePolicy


@pytest.mark.parametrize(
    "every_n_steps, after_step, steps_per_epoch, epochs, saves",
    [
        (None, 0, 5, 3, 3),  # each epoch's end
        (2, 0, 5, 2, 6),  # steps 2, 4, 5 (epoch end), 6, 8, 10
        (3, 0, 12, 1, 4),  # steps 3, 6, 9, 12: the epoch's end is one of them
        (3, 7, 12, 1, 2),  # resumed after step 7: 9 and 12
        (None, 10, 5, 2, 0),  # a finished run
    ],
)
def test_saves_counts_the_checkpoints_still_to_write(every_n_steps, after_step, steps_per_epoch, epochs, saves):
    length = RunLength(Parallelism(1), batch_size=1, gradient_accumulation_steps=1, epochs=epochs,
                       max_steps_per_epoch=None, samples=0, steps_per_epoch=steps_per_epoch)
    assert SavePolicy(every_n_steps).saves(after_step, length) == saves
