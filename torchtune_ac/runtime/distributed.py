"""Processes and devices: the one process context of a run (``DistributedContext``, created once by
``init_distributed`` and passed down, the checkpoint code included) and its collectives on the host. How the
processes split the work and its device mesh are ``parallelism.py``'s; FSDP2 and tensor parallelism ``parallel/``'s.

A single process is a world of size 1: the same functions run, they just skip the collectives. Under
PyTorch's elastic launcher (``tune run --nproc_per_node N``) the process group is initialised from the
environment it sets: on CUDA NCCL for CUDA tensors with gloo beside it for CPU tensors, on CPU gloo.

Host-side collectives run on gloo, never NCCL: torch sends object collectives (``broadcast_object_list``,
``all_gather_object``, which the checkpoint code, the output lock, the config agreement and the run's plan use) to a
group's CPU backend when it has one, and the one barrier, ``host_barrier`` (``DistributedContext.barrier``), reduces
a CPU tensor, since ``dist.barrier()`` on a group bound to a GPU runs on NCCL. While rank 0 alone writes, fsyncs and
prunes a checkpoint, the others wait there, where NCCL's watchdog does not look; every wait is bounded by the
group's ``timeout`` (``distributed_timeout_s``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.runtime.parallelism import Parallelism

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class DistributedContext:
    """Who this process is: its rank in the world, the world's size, the device it computes on, and how the world
    splits the work (``parallelism``: the run plan's, given to the context when the run is planned; until then, or
    outside a run, every process reads a data-parallel share of its own)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    parallelism: Optional[Parallelism] = None

    def __post_init__(self) -> None:
        if self.parallelism is None:
            object.__setattr__(self, "parallelism", Parallelism(self.world_size))
        elif self.parallelism.world_size != self.world_size:
            raise ValueError(f"a parallelism of {self.parallelism.world_size} processes for a world of "
                             f"{self.world_size}")

    @property
    def data_parallel_rank(self) -> int:
        """Which share of each global batch this rank reads: its tensor-parallel group's index."""
        return self.parallelism.data_parallel_rank(self.rank)

    @property
    def data_parallel_size(self) -> int:
        """How many shares each global batch is split into: the tensor-parallel groups."""
        return self.parallelism.data_parallel_size

    @property
    def reads_for_its_group(self) -> bool:
        """Whether this rank is the first of its tensor-parallel group (the one that speaks for the group's
        batch where the ranks' results are summed)."""
        return self.parallelism.speaks_for_its_group(self.rank)

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        """Wait until every rank gets here (``host_barrier``); nothing in a world of one."""
        if self.is_distributed:
            host_barrier()


# ``distributed_timeout_s``'s default: room for rank 0 to write, fsync and prune a large checkpoint while the
# other ranks wait (NCCL's own default, 10 minutes, is not).
DEFAULT_TIMEOUT_S = 1800


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> CUDA when present, else CPU; ``cuda`` -> this process's GPU (``cuda:<local_rank>``).

    Raises:
        UnavailableError: ``cuda`` was asked for on a machine without CUDA, or ``local_rank`` is not one of the
            GPUs this process sees (more processes per node than visible GPUs: under Slurm, often a
            ``CUDA_VISIBLE_DEVICES`` that gives each task one GPU while ``LOCAL_RANK`` counts the node's tasks).
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UnavailableError("device=cuda: CUDA is not available on this machine (use device=cpu or device=auto)")
        count = torch.cuda.device_count()
        if local_rank >= count:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise UnavailableError(
                f"LOCAL_RANK={local_rank}: this process sees {count} GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{'unset' if visible is None else repr(visible)}), so there is no GPU {local_rank} for it; start at "
                "most as many processes per node as it has visible GPUs (--nproc_per_node), and let every process "
                "see all of the node's GPUs"
            )
        return torch.device("cuda", local_rank)
    return torch.device(device)


def init_distributed(device: str, *, timeout_s: int = DEFAULT_TIMEOUT_S) -> DistributedContext:
    """Initialise the process group if this process was started by the elastic launcher.

    Args:
        device: ``auto``, ``cpu`` or ``cuda`` (the config's ``device``).
        timeout_s: how long a collective may wait before it fails (``distributed_timeout_s``), for NCCL and gloo.

    Returns:
        The context; world size 1 (and no process group) when not launched with several processes.

    Raises:
        UnavailableError: the device cannot be had (see ``resolve_device``).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    resolved = resolve_device(device, local_rank)
    if world_size > 1:
        _exit_with_launcher()
    if world_size > 1 and not dist.is_initialized():
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        dist.init_process_group(backend=_backend(resolved), timeout=timedelta(seconds=timeout_s),
                                device_id=resolved if resolved.type == "cuda" else None)
    return DistributedContext(rank=rank, world_size=world_size, local_rank=local_rank, device=resolved)


def set_tf32(device: torch.device, *, allow_tf32: bool) -> None:
    """On CUDA, let float32 matrix multiplies and cuDNN convolutions run in TF32 (``allow_tf32``), or not.

    torch's default is full float32 matmuls, which run several times slower than TF32 on Ampere and newer GPUs;
    TF32 rounds the inputs to a 10-bit mantissa and sums in float32. Nothing is set on a CPU, where these
    switches do nothing and ``allow_tf32`` is left as torch has it.
    """
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    torch.backends.cudnn.allow_tf32 = allow_tf32


def _exit_with_launcher() -> None:
    """Ask Linux to terminate this worker when its launcher dies.

    The elastic launcher starts each worker in a session of its own, so a hard kill of the launcher
    (SIGKILL, OOM killer) would otherwise leave workers training and writing to ``output_dir`` while the
    user resumes the run. Elsewhere than Linux this is a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    launcher = os.getppid()
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != launcher:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def destroy_distributed(*, synchronize: bool = False) -> None:
    """Tear down the process group, if any (safe to call twice).

    ``synchronize=True`` (the end of a successful run) first waits at a barrier, so no rank closes its
    connections while another is still finishing its part (rank 0 writing the last metrics, say). After a
    failure, pass ``False``: the other ranks may never arrive, and the launcher stops them anyway.
    """
    if dist.is_available() and dist.is_initialized():
        if synchronize:
            host_barrier()
        dist.destroy_process_group()


def host_barrier() -> None:
    """Wait on the host until every rank of the default process group gets here, over gloo.

    A sum of a CPU tensor, which the group hands to its CPU backend (gloo, beside NCCL on CUDA): ``dist.barrier()``
    on a group bound to a GPU would run on NCCL, whose watchdog then counts rank 0's checkpoint writing against
    the others. Bounded by the group's timeout.
    """
    dist.all_reduce(torch.zeros(1))


T = TypeVar("T")


def decided_by_rank_zero(ctx: DistributedContext, decide: Callable[[], T]) -> T:
    """Rank 0's ``decide()``, on every rank (all ranks call this): rank 0 alone decides, the others receive its
    answer (one object broadcast, on the host). A ``UserError`` rank 0 raises is raised on every rank with the same
    message, so a multi-process run says it once; any other failure on rank 0 makes the others raise a
    ``RuntimeError`` that names it, instead of waiting.

    Raises:
        UserError: rank 0's.
        RuntimeError: (ranks other than 0) rank 0 failed while deciding.
    """
    if not ctx.is_distributed:
        return decide()
    box: list[object] = [None]
    failure: Optional[BaseException] = None
    if ctx.is_rank_zero:
        try:
            box[0] = ("decided", decide())
        except UserError as err:
            box[0], failure = ("refused", str(err)), err
        except BaseException as err:  # noqa: BLE001 - told to the others, then raised here
            box[0], failure = ("failed", f"{type(err).__name__}: {err}"), err
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    outcome, value = box[0]
    if outcome == "refused":
        raise UserError(value)
    if outcome == "failed":
        raise RuntimeError(f"rank 0 failed while deciding for every rank: {value}")
    return value


def process_group_context(device: torch.device = torch.device("cpu")) -> DistributedContext:
    """This process as a rank of the initialised default process group, on ``device`` (a world of one without a
    group): for code handed a sharded model outside a run (``save_hf``), whose sharding says which processes take
    part. A run creates its context once, with ``init_distributed``, and passes it down."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    return DistributedContext(rank=dist.get_rank(), world_size=dist.get_world_size(),
                              local_rank=int(os.environ.get("LOCAL_RANK", "0")), device=device)


def all_reduce_sum(value: torch.Tensor, ctx: DistributedContext) -> torch.Tensor:
    """Sum ``value`` over all ranks (returns a new tensor; identity in a world of one)."""
    value = value.clone()
    if ctx.is_distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def join_world_of_one(device: torch.device) -> None:
    """Make this single process the one rank of a process group, so that FSDP2 can shard its model (a memory
    switch that works through ``fully_shard``, such as CPU offload, applies to one process too). Does nothing
    when a process group exists. ``destroy_distributed`` tears it down as any other."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # An in-memory store: one rank has no one to meet, so no address or port is needed.
    dist.init_process_group(backend=_backend(device), store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)


def _backend(device: torch.device) -> str:
    """NCCL for CUDA tensors, with gloo beside it for CPU tensors: the host-side collectives (objects, barriers)
    and, for a model whose shards FSDP2 keeps in host memory (CPU offload), its gradient norm. On a CPU, gloo."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
