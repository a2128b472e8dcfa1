"""DPO's precomputed reference (``dpo.reference: precomputed``): the frozen reference model run once over the pairs
the run reads, its log-probabilities kept with them, and the model freed before the policy and its optimizer exist.

    precompute_reference        build the reference, one pass over the pairs read, free it     (every rank)
    pairs_read                  the training pairs a run of this length reads, over all ranks
    precompute_reference_logps  one pass of a reference over a dataset's pairs (or some of them)

A stop signal during the pass ends the run between two of its batches, before training, with nothing to save.
"""

from __future__ import annotations

import gc
import itertools
import logging
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.data import Subset

from torchtune_ac.data.preference import PreferenceDataset
from torchtune_ac.data.sampler import evaluation_batches
from torchtune_ac.data.samples import count_of
from torchtune_ac.run import messages
from torchtune_ac.data.batching import PAIRS
from torchtune_ac.run.phases import RunData, ValidationData
from torchtune_ac.run.length import RunLength
from torchtune_ac.run.session import Run
from torchtune_ac.runtime.distributed import DistributedContext, all_reduce_sum
from torchtune_ac.training.dpo import reference_logps
from torchtune_ac.training.step import move_batch

log = logging.getLogger("torchtune_ac.run")
PASS = "the reference's pass"  # what a stop signal's lines call it


def pairs_read(loader: Any, length: RunLength) -> Optional[list[int]]:
    """The training pairs (dataset indices, sorted) that a run of ``length`` reads over all its epochs and ranks;
    None when it reads every pair. A resumed run reads fewer: these are the whole run's."""
    sampler = loader.batch_sampler
    steps = length.steps_per_epoch * length.gradient_accumulation_steps  # the loader's batches per epoch
    read = torch.cat([sampler.indices_read(epoch, steps) for epoch in range(length.epochs)]).unique()
    return None if len(read) == sampler.num_samples else read.tolist()


def precompute_reference_logps(reference: nn.Module, dataset: PreferenceDataset, *, batch_size: int,
                               ctx: DistributedContext, pad_id: int, n_chunks: int = 1,
                               padding: Optional[dict[str, Any]] = None, indices: Optional[Sequence[int]] = None,
                               after_batch: Optional[Callable[[int, int], None]] = None) -> None:
    """Run the frozen reference once over ``dataset`` and keep its log-probabilities with the pairs
    (``dataset.set_reference_logps``): every rank computes its share of the pairs, and one all-reduce gives every
    rank all of them. Every rank calls this with the same arguments (a sharded forward is a collective).

    Args:
        reference: the frozen reference model (``assemble.build_reference``).
        dataset: the pairs (training or validation).
        batch_size: samples (pairs, or packed rows of pairs) per process per forward.
        ctx: this rank's place in the run.
        pad_id: the tokenizer's padding id.
        n_chunks: the resolved ``loss_chunks``.
        padding: how batches are padded (``pad_to_multiple_of``, ``max_length``), as the training batches are.
        indices: the samples to compute (``pairs_read``); the others' pairs are left NaN, and reading one raises.
            None: all.
        after_batch: called on every rank after each batch with (batches done, batches in all); it may raise to end
            the pass (a stop signal).
    """
    samples = list(range(len(dataset))) if indices is None else list(indices)
    pairs = dataset if indices is None else Subset(dataset, samples)
    # The pairs each sample holds (one, or a packed row's several), in the samples' order: where each sample's
    # pairs go in ``logps``.
    spans = [dataset.pair_range(i, i + 1) for i in samples]
    ends = [0, *itertools.accumulate(stop - start for start, stop in spans)]
    logps = torch.zeros(ends[-1], 2, dtype=torch.float64, device=ctx.device)  # [pairs, (chosen, rejected)]
    # A tensor-parallel group computes its share together; its first rank alone writes it down.
    batches = evaluation_batches(pairs, batch_size=batch_size, pad_id=pad_id, rank=ctx.data_parallel_rank,
                                 world_size=ctx.data_parallel_size, collate=PAIRS.collate, blank=PAIRS.blank,
                                 **(padding or {}))
    global_batch = batch_size * ctx.data_parallel_size
    total = -(-len(pairs) // global_batch)
    for index, batch in enumerate(batches):
        first = index * global_batch + ctx.data_parallel_rank * batch_size
        computed = reference_logps(reference, move_batch(batch, ctx.device), n_chunks).double()  # [2b]
        count = max(0, min(batch_size, len(pairs) - first)) if ctx.reads_for_its_group else 0  # the rest: fillers
        low, high = ends[min(first, len(samples))], ends[min(first + count, len(samples))]
        logps[low:high] = torch.stack(computed.chunk(2), dim=1)[:high - low]  # [pairs, 2]
        if after_batch is not None:
            after_batch(index + 1, total)
    logps = all_reduce_sum(logps, ctx).cpu()
    if indices is not None:
        every = torch.full((dataset.pair_count, 2), float("nan"), dtype=torch.float64)
        every[torch.tensor([pair for start, stop in spans for pair in range(start, stop)], dtype=torch.long)] = logps
        logps = every
    dataset.set_reference_logps(logps)


def precompute_reference(run: Run, make_reference: Callable[[], nn.Module], data: RunData,
                         validation: Optional[ValidationData], *, length: RunLength, batch_size: int, pad_id: int,
                         n_chunks: int) -> None:
    """``dpo.reference: precomputed``: build the reference (``make_reference``, which no one else holds), run it
    over the training pairs the run reads (``pairs_read``) and every validation pair, and free it before returning.

    FSDP2's state and hooks hold reference cycles between a sharded model's modules, so dropping the last reference
    frees nothing until a garbage collection runs; one runs here, so the reference's shards are gone before the
    policy and its optimizer are built.

    Raises:
        RunStopped: a stop signal reached some rank during the pass (every rank stops after the same batch).
    """
    ctx = run.ctx
    read = pairs_read(data.loader, length)
    dataset = data.loader.dataset
    if ctx.is_rank_zero:
        train = (f"all {len(dataset):,} training pairs" if read is None else
                 f"the {len(read):,} of {len(dataset):,} training pairs the run reads ({length.total_steps} steps)")
        held_out = "" if validation is None else f" and {count_of(len(validation.dataset), 'validation pair')}"
        log.info("dpo: precomputing the reference's log-probabilities of %s%s; the reference is then freed",
                 train, held_out)

    def after_batch(done: int, total: int) -> None:
        stop = run.stop.agreed(ctx)  # every rank stops after the same batch
        if stop is not None:
            raise messages.stopped_before_training(stop, f"{PASS} (batch {done} of {total})",
                                                   announce=ctx.is_rank_zero)

    run.setting_up = PASS  # from here a stop signal ends the pass after a batch
    reference = make_reference()
    try:
        precompute_reference_logps(reference, dataset, batch_size=batch_size, ctx=ctx, pad_id=pad_id,
                                   n_chunks=n_chunks, indices=read, after_batch=after_batch)
        if validation is not None:
            precompute_reference_logps(reference, validation.dataset, batch_size=batch_size, ctx=ctx, pad_id=pad_id,
                                       n_chunks=n_chunks, after_batch=after_batch)
    finally:
        run.setting_up = None
        del reference
        gc.collect()
