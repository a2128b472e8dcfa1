"""How long a run is and when it saves: the run's shape (``RunLength``: samples a step, steps an epoch, steps in
all, counted once the data is read) and its save policy (``SavePolicy``), two values of the run's plan
(``plan.py``'s ``RunPlan``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from torchtune_ac.data.samples import count_of
from torchtune_ac.errors import UserError
from torchtune_ac.runtime.parallelism import Parallelism


@dataclass(frozen=True)
class RunLength:
    """The run's shape: how many samples make an optimizer step, and how many steps make the run.

    Attributes:
        parallelism: how the processes split the work: the batch is split over its data-parallel size.
        batch_size: samples per process per micro-batch.
        gradient_accumulation_steps: micro-batches per step.
        epochs: passes over the data.
        max_steps_per_epoch: the config's cap (None: none).
        samples: samples in the dataset, rows when packed (None: the data was not read, as ``tune validate`` and
            ``tune plan`` do).
        steps_per_epoch: optimizer steps per epoch, the cap applied (None with ``samples``).
        described: what the dataset holds, for the log (``3,000 samples``, or ``packed: ... -> 412 rows ...``).
        unit: what one of ``samples`` is: ``sample``, or ``row`` when packed.
        optimizer_steps_per_step: optimizer steps one step takes (GRPO's ``grpo.num_iterations`` on each rollout;
            otherwise 1): the learning-rate schedule counts optimizer steps.
    """

    parallelism: Parallelism
    batch_size: int
    gradient_accumulation_steps: int
    epochs: int
    max_steps_per_epoch: Optional[int]
    samples: Optional[int] = None
    steps_per_epoch: Optional[int] = None
    described: Optional[str] = None
    unit: str = "sample"
    optimizer_steps_per_step: int = 1

    @property
    def world_size(self) -> Optional[int]:
        return self.parallelism.world_size

    @property
    def data_parallel_size(self) -> Optional[int]:
        """How many shares each global batch is split into (None when the world size is not known)."""
        return self.parallelism.data_parallel_size

    @property
    def per_process(self) -> int:
        """Samples per process per optimizer step."""
        return self.batch_size * self.gradient_accumulation_steps

    @property
    def global_batch(self) -> Optional[int]:
        """Samples per optimizer step over every process, a tensor-parallel group's counted once (None when the
        world size is not known)."""
        return None if self.world_size is None else self.per_process * self.data_parallel_size

    @property
    def total_steps(self) -> Optional[int]:
        """Steps of the whole run (None when the data was not read)."""
        return None if self.steps_per_epoch is None else self.steps_per_epoch * self.epochs

    @property
    def optimizer_steps(self) -> Optional[int]:
        """Optimizer steps of the whole run, what the learning-rate schedule spans (None when the data was not
        read)."""
        return None if self.total_steps is None else self.total_steps * self.optimizer_steps_per_step

    def counted(self, samples: int, batches_per_epoch: int, *, described: Optional[str] = None,
                unit: str = "sample") -> "RunLength":
        """This length once the data is read: the one place steps per epoch are computed.

        Args:
            samples: samples in the dataset (rows, when packed).
            batches_per_epoch: micro-batches per process per epoch (the loader's length, the same on every rank).
            described: what the dataset holds, for messages (default: the count of samples).
            unit: what one of ``samples`` is.

        Raises:
            UserError: the dataset has fewer batches per process than one optimizer step needs.
        """
        described = described if described is not None else count_of(samples, unit)
        steps = batches_per_epoch // self.gradient_accumulation_steps
        if self.max_steps_per_epoch is not None:
            steps = min(steps, self.max_steps_per_epoch)
        if steps == 0:
            raise UserError(
                f"dataset: {described} make {batches_per_epoch} batch(es) per process per epoch, fewer than "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps} (reduce batch_size or accumulation)"
            )
        return dataclasses.replace(self, samples=samples, steps_per_epoch=steps, described=described, unit=unit)



@dataclass(frozen=True)
class SavePolicy:
    """When a step ends with a checkpoint (at the end of every epoch, every ``every_n_steps`` steps when set, and on
    a stop signal), and which checkpoints are kept (``keep_last_n``: the newest N whole; None: see
    ``checkpoint/recipe_state.py``)."""

    every_n_steps: Optional[int] = None
    keep_last_n: Optional[int] = None

    def should_save(self, step: int, *, epoch_done: bool, stopping: bool) -> bool:
        return epoch_done or stopping or bool(self.every_n_steps and step % self.every_n_steps == 0)

    def saves(self, after_step: int, length: "RunLength") -> int:
        """The checkpoints a run of ``length`` (its data read) writes from ``after_step`` to its end (no stop
        signal)."""
        return sum(self.should_save(step, epoch_done=step % length.steps_per_epoch == 0, stopping=False)
                   for step in range(after_step + 1, length.total_steps + 1))

    def describe(self) -> str:
        when = "at the end of every epoch" + (f", every {self.every_n_steps} steps" if self.every_n_steps else "")
        kept = (f"the newest {self.keep_last_n} kept" if self.keep_last_n is not None
                else "every checkpoint's model kept, the recipe state (to resume from) of the newest two")
        return f"{when} and on a stop signal; {kept}"
