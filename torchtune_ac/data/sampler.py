"""Deterministic sharded batching: which samples each rank reads at each step, and resuming mid-epoch.

The global batch of step ``t`` is ``perm[t*B : (t+1)*B]`` with ``B = batch_size * world_size``, and rank ``r``
reads the contiguous block ``perm[t*B + r*batch_size : t*B + (r+1)*batch_size]``. So two ranks with batch size
``b`` see, together, exactly the samples one rank with batch size ``2b`` sees at the same step, and no two ranks
share a sample within a step. ``perm`` is ``torch.randperm`` seeded with ``seed + epoch`` (the identity when
``shuffle`` is false), so every rank computes the same permutation without communicating.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from torchtune_ac.data.collate import collate_batch
from torchtune_ac.data.samples import IGNORE_INDEX
from torchtune_ac.errors import UserError

logger = logging.getLogger(__name__)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's list of dataset indices for each step of an epoch.

    With ``drop_last`` the samples that do not fill a last global batch are left out of the epoch; without it,
    the last global batch is completed with samples from the start of the permutation, so every rank still
    gets ``batch_size`` indices (ranks must run the same number of equally sized steps).

    Resume mid-epoch with ``set_epoch(epoch)`` and ``skip_steps(n)``: the next iteration starts at step ``n`` of
    that epoch and yields exactly what an uninterrupted iteration would have from there.

    Args:
        num_samples: Dataset length.
        batch_size: Samples per rank per step.
        rank: This process's rank.
        world_size: Number of ranks reading the dataset.
        shuffle: Permute the dataset each epoch.
        seed: Base seed; epoch ``e`` uses ``seed + e``.
        drop_last: Leave out the samples that do not fill a last global batch.

    Raises:
        UserError: if ``batch_size`` is not positive, or the dataset cannot fill one global batch with ``drop_last``.
        ValueError: for an impossible ``rank``/``world_size``.
    """

    def __init__(
        self,
        num_samples: int,
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
        if batch_size < 1:
            raise UserError(f"batch_size={batch_size}: must be a positive integer")
        global_batch = batch_size * world_size
        if num_samples < 1 or (drop_last and num_samples < global_batch):
            raise UserError(
                f"the dataset has {num_samples} samples, fewer than one global batch "
                f"(batch_size={batch_size} x {world_size} ranks = {global_batch}); lower batch_size"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self._start_step = 0

    def __len__(self) -> int:
        """Steps in a full epoch (the same on every rank)."""
        global_batch = self.batch_size * self.world_size
        if self.drop_last:
            return self.num_samples // global_batch
        return -(-self.num_samples // global_batch)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` from the next iteration on."""
        self.epoch = epoch

    def skip_steps(self, steps: int) -> None:
        """Start the next iteration at step ``steps`` of the epoch (once; later iterations start at 0).

        Raises:
            UserError: if ``steps`` is beyond the end of the epoch (the dataset or batch size changed since the
                checkpoint being resumed).
        """
        if not 0 <= steps <= len(self):
            raise UserError(
                f"cannot resume at step {steps} of an epoch that has {len(self)} steps; "
                "did the dataset, batch_size or number of processes change since the checkpoint?"
            )
        self._start_step = steps

    def permutation(self, epoch: Optional[int] = None) -> torch.Tensor:
        """The order of dataset indices for ``epoch`` (default: the current one), ``LongTensor[num_samples]``."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + (self.epoch if epoch is None else epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def _wrapped(self, perm: torch.Tensor) -> torch.Tensor:
        """``perm``, repeated so that the epoch's last global batch is complete (possibly several times for a tiny
        dataset)."""
        read = len(self) * self.batch_size * self.world_size
        return perm.repeat(-(-read // self.num_samples)) if read > self.num_samples else perm

    def indices_read(self, epoch: int, steps: int) -> torch.Tensor:
        """The dataset indices that every rank together reads in the first ``steps`` steps of ``epoch``, in the
        order read (an index may repeat where the last global batch wraps around)."""
        steps = min(steps, len(self))
        return self._wrapped(self.permutation(epoch))[: steps * self.batch_size * self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        perm = self._wrapped(self.permutation())
        global_batch = self.batch_size * self.world_size
        steps = len(self)
        start, self._start_step = self._start_step, 0
        for step in range(start, steps):
            first = step * global_batch + self.rank * self.batch_size
            yield perm[first : first + self.batch_size].tolist()


class ShardedDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ShardedBatchSampler`, with the sampler's epoch and resume controls."""

    batch_sampler: ShardedBatchSampler

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`ShardedBatchSampler.set_epoch`."""
        self.batch_sampler.set_epoch(epoch)

    def skip_steps(self, steps: int) -> None:
        """See :meth:`ShardedBatchSampler.skip_steps`."""
        self.batch_sampler.skip_steps(steps)


def build_dataloader(
    dataset: Dataset,
    *,
    batch_size: int,
    pad_id: int,
    rank: int = 0,
    world_size: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    pad_to_multiple_of: int = 1,
    max_length: int | None = None,
    pin_memory: bool = False,
    collate: Callable[..., dict[str, torch.Tensor]] = collate_batch,
    announce: bool | None = None,
) -> ShardedDataLoader:
    """Batches of this rank's shard, collated with ``collate`` (:func:`collate_batch`), read in the main process.

    Args:
        dataset: Any map-style dataset of samples (``len`` and indexing).
        batch_size: Samples per rank per step.
        pad_id: Token id for padding.
        rank: This process's rank.
        world_size: Number of ranks.
        shuffle: Permute the dataset each epoch.
        seed: Base seed of the permutation.
        drop_last: Leave out samples that do not fill a last global batch.
        pad_to_multiple_of: Round each batch's length up to a multiple of this...
        max_length: ...but not beyond this.
        pin_memory: Put each batch in page-locked host memory (for a CUDA run: its copy to the GPU is then
            asynchronous, as ``non_blocking=True`` asks).
        collate: Makes a batch of samples, called with ``pad_id``, ``pad_to_multiple_of`` and ``max_length``
            (``collate_batch``; preference pairs have ``data.preference.collate_preference_batch``).
        announce: Whether this process logs what building the dataset cut or dropped (None: ``rank == 0``; under
            tensor parallelism every rank of the first group has data rank 0, and only the run's rank 0 says it).

    Returns:
        The loader; call ``set_epoch`` before each epoch and ``skip_steps`` to resume mid-epoch.

    Raises:
        UserError: see :class:`ShardedBatchSampler`.

    Rank 0 (``announce``) logs, once, what building the dataset cut or dropped (its ``report``, see ``samples.DataReport``), and
    when packing it changed nothing (``samples.PackingReport.unchanged``).
    """
    sampler = ShardedBatchSampler(
        len(dataset),
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
    announce = rank == 0 if announce is None else announce
    report = getattr(dataset, "report", None)
    if report and announce:
        logger.warning(report)
    packing = getattr(dataset, "packing", None)
    if packing is not None and announce and packing.unchanged() is not None:
        logger.warning("data: %s", packing.unchanged())
    collate = functools.partial(collate, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of,
                                max_length=max_length)
    # A generator of its own: otherwise each iter() draws a seed from the global RNG, which would shift
    # dropout masks after a mid-epoch resume (the global RNG state is restored before iteration starts).
    return ShardedDataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=0, generator=torch.Generator(),
        pin_memory=pin_memory,
    )


def blank_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``sample`` that counts for nothing: every label ignored."""
    return {**sample, "labels": [IGNORE_INDEX] * len(sample["labels"])}


def evaluation_batches(
    dataset: Dataset, *, batch_size: int, pad_id: int, rank: int = 0, world_size: int = 1,
    pad_to_multiple_of: int = 1, max_length: int | None = None,
    collate: Callable[..., dict[str, torch.Tensor]] = collate_batch,
    blank: Callable[[dict[str, Any]], dict[str, Any]] = blank_sample,
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches of one pass over ``dataset`` in order, for an evaluation: every sample exactly once
    over all ranks.

    Every rank yields the same number of ``batch_size`` batches (a sharded model's forward is a collective, so
    ranks must run equally many). Rank ``r``'s batch ``t`` holds the samples at positions
    ``t*B + r*batch_size ...`` with ``B = batch_size * world_size``; positions past the end are filled with the
    first sample with every label ignored (``blank``), so they count towards no loss and no target. Batches are
    made by ``collate`` (``collate_batch``), padded as it says (``pad_to_multiple_of``, ``max_length``).

    Raises:
        UserError: the dataset is empty, or ``batch_size`` is not positive.
    """
    if len(dataset) == 0:
        raise UserError("dataset_val: holds no sample")
    if batch_size < 1:
        raise UserError(f"batch_size_val={batch_size}: must be a positive integer")
    global_batch = batch_size * world_size
    for start in range(0, len(dataset), global_batch):
        samples = []
        for position in range(start + rank * batch_size, start + (rank + 1) * batch_size):
            if position < len(dataset):
                samples.append(dataset[position])
            else:
                samples.append(blank(dataset[0]))
        yield collate(samples, pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, max_length=max_length)
