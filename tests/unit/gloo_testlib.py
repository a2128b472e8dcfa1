"""Run a test function on several CPU processes joined by a gloo process group, torn down cleanly.

Every rank meets a rendezvous file (not a TCP port picked in advance, which another process may take before
rank 0 binds it). A rank whose function succeeded waits at a barrier before destroying the process group, so
no rank tears down its connections while another still runs its part: the documented way to shut down, and
what the recipe does at the end of a run. A rank whose function raised destroys its group at once (a barrier
would only hang until the timeout) and the error reaches the test through ``mp.spawn``.

A rank that succeeded then leaves with ``os._exit(0)``, skipping the interpreter's teardown: under load a C++
destructor race there (gloo's threads, "terminate called without an active exception") has killed an already
finished rank with SIGABRT a few times in a hundred runs, failing a test whose work had passed.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2
TIMEOUT = timedelta(seconds=120)


def _rank_main(rank: int, fn: Callable[..., None], store: str, world_size: int, args: tuple[Any, ...]) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    try:
        fn(rank, *args)
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    if dist.is_initialized():  # ``fn`` may have torn the group down itself
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_gloo_ranks(fn: Callable[..., None], *args: Any, store_dir: Path, world_size: int = WORLD_SIZE) -> None:
    """Call ``fn(rank, *args)`` in ``world_size`` spawned processes; re-raise the first rank's failure.

    ``fn`` must be importable (a module-level function), as ``mp.spawn`` pickles it by name. ``store_dir``
    is a fresh folder (a test's ``tmp_path``) for the rendezvous file.
    """
    store = Path(store_dir) / "gloo_rendezvous"
    if store.exists():
        raise FileExistsError(f"{store} exists: a rendezvous file must be new")
    mp.spawn(_rank_main, args=(fn, str(store), world_size, args), nprocs=world_size, join=True)
