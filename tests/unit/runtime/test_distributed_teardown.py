"""Shutting down a gloo process group: after a successful run every rank waits for the others; after a failure
no rank waits for ranks that may never come."""

import time

import pytest
import torch
from gloo_testlib import run_on_gloo_ranks

from torchtune_ac.runtime.distributed import destroy_distributed

LATE_BY = 1.0  # seconds rank 0 takes longer than rank 1 to finish its part


def finish_and_tear_down(rank: int, synchronize: bool, out_path: str) -> None:
    if rank == 0:
        time.sleep(LATE_BY)  # e.g. rank 0 writing the last metrics and the final checkpoint
    arrived = time.time()
    destroy_distributed(synchronize=synchronize)
    destroy_distributed(synchronize=synchronize)  # safe to call twice
    torch.save({"arrived": arrived, "left": time.time()}, f"{out_path}.{rank}")


@pytest.mark.distributed
@pytest.mark.parametrize("synchronize", [True, False])
def test_tear_down_waits_for_every_rank_only_after_success(tmp_path, synchronize):
    out_path = str(tmp_path / "times")
    run_on_gloo_ranks(finish_and_tear_down, synchronize, out_path, store_dir=tmp_path)
    rank0, rank1 = (torch.load(f"{out_path}.{rank}") for rank in range(2))
    if synchronize:
        assert rank1["left"] >= rank0["arrived"]  # rank 1 closed nothing while rank 0 was still working
    else:
        assert rank1["left"] < rank0["arrived"]  # a failed run does not wait at a barrier
