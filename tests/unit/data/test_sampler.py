"""Sharded batch sampler: the 2 ranks x b == 1 rank x 2b property, disjoint shards, determinism, resume."""

import pytest
import torch

from torchtune_ac.data import IGNORE_INDEX, ShardedBatchSampler, TokenizedDataset, build_dataloader, collate_batch
from torchtune_ac.errors import UserError


def run_epoch(sampler: ShardedBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.parametrize(
    "num_samples, batch_size, world_size, shuffle, drop_last",
    [
        (40, 2, 2, True, True),
        (41, 3, 2, True, True),
        (37, 2, 4, True, False),
        (10, 1, 3, False, True),
        (5, 2, 2, True, False),  # fewer samples than a global batch: wraps around
    ],
)
def test_ranks_together_see_what_one_rank_with_the_global_batch_sees(
    num_samples, batch_size, world_size, shuffle, drop_last
):
    common = {"shuffle": shuffle, "seed": 7, "drop_last": drop_last}
    single = ShardedBatchSampler(num_samples, batch_size=batch_size * world_size, **common)
    ranks = [
        ShardedBatchSampler(num_samples, batch_size=batch_size, rank=r, world_size=world_size, **common)
        for r in range(world_size)
    ]
    assert all(len(s) == len(single) for s in ranks)
    for epoch in range(3):
        expected = run_epoch(single, epoch)
        per_rank = [run_epoch(s, epoch) for s in ranks]
        for step, global_batch in enumerate(expected):
            shards = [per_rank[r][step] for r in range(world_size)]
            assert sum(shards, []) == global_batch
            assert all(len(shard) == batch_size for shard in shards)


@pytest.mark.parametrize("world_size, batch_size", [(2, 3), (4, 1)])
def test_shards_are_disjoint_and_cover_the_epoch(world_size, batch_size):
    num_samples = 50
    seen = []
    for rank in range(world_size):
        sampler = ShardedBatchSampler(num_samples, batch_size=batch_size, rank=rank, world_size=world_size, seed=3)
        seen.extend(i for batch in run_epoch(sampler, 1) for i in batch)
    steps = num_samples // (batch_size * world_size)
    assert len(seen) == len(set(seen)) == steps * batch_size * world_size
    assert set(seen) <= set(range(num_samples))


def test_permutation_is_seeded_by_seed_plus_epoch():
    a = ShardedBatchSampler(30, batch_size=5, seed=10)
    b = ShardedBatchSampler(30, batch_size=5, seed=10)
    assert run_epoch(a, 0) == run_epoch(b, 0)
    assert run_epoch(a, 0) != run_epoch(a, 1)
    flat = [i for batch in run_epoch(a, 2) for i in batch]
    assert flat == torch.randperm(30, generator=torch.Generator().manual_seed(12)).tolist()
    ordered = ShardedBatchSampler(30, batch_size=5, shuffle=False)
    assert [i for batch in run_epoch(ordered, 4) for i in batch] == list(range(30))


@pytest.mark.parametrize("skip", [0, 1, 4, 6])
def test_resume_mid_epoch_matches_uninterrupted(skip):
    full = run_epoch(ShardedBatchSampler(26, batch_size=2, rank=1, world_size=2, seed=5), epoch=3)
    resumed = ShardedBatchSampler(26, batch_size=2, rank=1, world_size=2, seed=5)
    resumed.skip_steps(skip)  # order relative to set_epoch does not matter
    resumed.set_epoch(3)
    assert list(resumed) == full[skip:]
    assert list(resumed) == full  # the skip applies to one iteration only


@pytest.mark.parametrize(
    "num_samples, kwargs, message",
    [
        (10, {"batch_size": 0}, "batch_size=0: must be a positive integer"),
        (5, {"batch_size": 3, "world_size": 2, "rank": 1}, "the dataset has 5 samples, fewer than one global batch"),
        (0, {"batch_size": 1, "drop_last": False}, "the dataset has 0 samples"),
    ],
)
def test_sampler_user_errors(num_samples, kwargs, message):
    with pytest.raises(UserError, match=message):
        ShardedBatchSampler(num_samples, **kwargs)


def test_skipping_past_the_epoch_is_a_user_error():
    sampler = ShardedBatchSampler(10, batch_size=2)
    with pytest.raises(UserError, match="cannot resume at step 6 of an epoch that has 5 steps"):
        sampler.skip_steps(6)


def test_dataloader_batches_this_ranks_shard():
    dataset = TokenizedDataset(("tokens", "labels"))
    for i in range(12):
        dataset.append({"tokens": [i] * (1 + i % 3), "labels": [-100] * (1 + i % 3)})
    loader = build_dataloader(dataset, batch_size=2, rank=1, world_size=2, shuffle=True, seed=1, pad_id=-1)
    sampler = ShardedBatchSampler(12, batch_size=2, rank=1, world_size=2, seed=1)
    loader.set_epoch(2)
    loader.skip_steps(1)
    batches = list(loader)
    expected = run_epoch(sampler, 2)[1:]
    assert len(loader) == 3 and len(batches) == 2
    for batch, indices in zip(batches, expected):
        reference = collate_batch([dataset[i] for i in indices], pad_id=-1)
        assert torch.equal(batch["tokens"], reference["tokens"])
        assert batch["tokens"][:, 0].tolist() == indices


def test_an_evaluation_pass_reads_every_sample_once_over_all_ranks():
    from torchtune_ac.data.sampler import evaluation_batches

    samples = [{"tokens": [i, i], "labels": [i, i]} for i in range(7)]
    seen = []
    steps = []
    for rank in range(2):
        batches = list(evaluation_batches(samples, batch_size=2, pad_id=0, rank=rank, world_size=2))
        steps.append(len(batches))
        for batch in batches:
            for row in batch["labels"].tolist():
                if row != [IGNORE_INDEX, IGNORE_INDEX]:
                    seen.append(row[0])
    assert steps == [2, 2]  # the same number of batches on every rank
    assert sorted(seen) == list(range(7))  # every sample once; the filler of the last batch counts nowhere
