"""Processes and devices: the one process context of a run (``DistributedContext``, created once by
``init_distributed`` and passed down, the checkpoint code included), its collectives on the host, and FSDP2's keys
and device mesh. Applying FSDP2 to a model is ``training/fsdp.py``'s.

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
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtune_ac.config_key import config_key
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.runtime.dtypes import DType

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class FSDPConfig:
    """The ``fsdp.*`` config keys: FSDP2's settings, used when the model is sharded (more than one process, or CPU
    offload on one). A field's ``torchtune`` metadata names torchtune's key for it (``tune migrate`` reads it)."""

    reshard_after_forward: bool = config_key(
        True, doc="Free each block's gathered parameters after its forward (saves memory; they are gathered again in "
        "backward).", torchtune="fsdp_reshard_after_forward")
    param_dtype: Optional[DType] = config_key(
        None, doc="Mixed precision: the dtype parameters are gathered in for forward and backward; null: as stored "
        "(dtype).")
    reduce_dtype: Optional[DType] = config_key(
        None, doc="The dtype of the gradient reduce-scatter; null: the storage dtype (dtype), so bf16 gradients are "
        "not upcast for the collective and cast back (fp32 sums in fp32, at twice the bytes).")
    replicate_degree: int = config_key(
        1, doc="HSDP: the processes form replicate_degree rows; parameters are sharded over the processes of a row "
        "(world size / replicate_degree) and replicated over the rows. 1: plain FSDP over every process.",
        minimum=1, torchtune="data_parallel_replicate_dim")
    cpu_offload: bool = config_key(
        False, doc="Keep parameters, gradients and optimizer state in pinned host memory, the optimizer stepping on "
        "the CPU (FSDP2's CPUOffloadPolicy); CUDA only. One process shards its model too, to get it.",
        torchtune="fsdp_cpu_offload")

    def resolved_reduce_dtype(self, dtype: DType) -> DType:
        """The reduce-scatter's dtype for parameters stored in ``dtype``."""
        return self.reduce_dtype if self.reduce_dtype is not None else dtype

    def shard_degree(self, world_size: int, tp_degree: int = 1) -> int:
        """Processes FSDP2 shards each parameter over: ``world_size / (replicate_degree * tp_degree)`` (tensor
        parallelism splits the parameter over ``tp_degree`` more).

        Raises:
            UserError: ``world_size`` is not a multiple of ``replicate_degree * tp_degree``.
        """
        check_replicate_degree(self.replicate_degree, world_size, tp_degree)
        return world_size // (self.replicate_degree * tp_degree)


def check_replicate_degree(replicate_degree: int, world_size: int, tp_degree: int = 1) -> None:
    """Raise ``UserError`` unless ``world_size`` processes form whole rows of ``replicate_degree`` replicas, each of
    whole tensor-parallel groups of ``tp_degree`` (the world size a product of the degrees)."""
    if world_size % (replicate_degree * tp_degree) == 0:
        return
    if tp_degree == 1:
        raise UserError(
            f"fsdp.replicate_degree={replicate_degree}: the world size ({world_size} process(es)) must be a multiple "
            "of it (each replica shards the model over world size / replicate_degree processes)"
        )
    raise UserError(
        f"tensor_parallel_dim={tp_degree}, fsdp.replicate_degree={replicate_degree}: the world size ({world_size} "
        f"process(es)) must be a multiple of their product ({replicate_degree * tp_degree}): it is replicate x "
        "shard x tensor-parallel processes"
    )


@dataclass(frozen=True)
class DistributedContext:
    """Who this process is: rank, world size, the device it computes on, and how many consecutive ranks split each
    layer among them (``tp_degree``, ``tensor_parallel_dim``): those ranks form one tensor-parallel group, which
    reads one batch together, so the data is split over ``data_parallel_size`` groups, not over the ranks."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    tp_degree: int = 1

    @property
    def data_parallel_rank(self) -> int:
        """Which share of each global batch this rank reads: its tensor-parallel group's index."""
        return self.rank // self.tp_degree

    @property
    def data_parallel_size(self) -> int:
        """How many shares each global batch is split into: the tensor-parallel groups."""
        return self.world_size // self.tp_degree

    @property
    def reads_for_its_group(self) -> bool:
        """Whether this rank is the first of its tensor-parallel group (the one that speaks for the group's
        batch where the ranks' results are summed)."""
        return self.rank % self.tp_degree == 0

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


TP_DIM = "tp"  # the mesh dimension tensor parallelism splits layers over


def build_device_mesh(device_type: str, world_size: int, replicate_degree: int = 1, tp_degree: int = 1) -> DeviceMesh:
    """The device mesh of a run, of ``device_type`` (the run's device, not whichever accelerator the machine has:
    ``device: cpu`` on a GPU host must shard over gloo on the CPU).

    Without tensor parallelism: a 1-D mesh ``("shard",)`` over every process, or with ``replicate_degree`` > 1
    HSDP's 2-D mesh ``("replicate", "shard")``: ``replicate_degree`` rows of ``world_size / replicate_degree``
    processes (consecutive ranks share a row, so with one node per row the shard collectives stay inside a node).
    With ``tp_degree`` > 1 a last dimension ``"tp"`` of ``tp_degree`` consecutive ranks (the GPUs of one node, where
    tensor parallelism's many small collectives are fast): ``("shard", "tp")`` or ``("replicate", "shard", "tp")``.
    FSDP2 shards over the mesh without its ``tp`` dimension (``data_parallel_mesh``). Every group of the mesh waits
    as long as the default group (``distributed_timeout_s``).

    Args:
        device_type: ``cpu`` or ``cuda``.
        world_size: processes in the default process group (1: a world of one).
        replicate_degree: HSDP's replicas (``fsdp.replicate_degree``); 1: plain FSDP.
        tp_degree: processes each layer is split over (``tensor_parallel_dim``); 1: none.

    Raises:
        UserError: ``world_size`` is not a multiple of ``replicate_degree * tp_degree``.
    """
    check_replicate_degree(replicate_degree, world_size, tp_degree)
    shard_degree = world_size // (replicate_degree * tp_degree)
    shape, names = (replicate_degree, shard_degree), ("replicate", "shard")
    if replicate_degree == 1:
        shape, names = shape[1:], names[1:]
    if tp_degree > 1:
        shape, names = (*shape, tp_degree), (*names, TP_DIM)
    with warnings.catch_warnings():
        # On CUDA, torch splits each sub-group from the default group and hands the NCCL side's options to the gloo
        # side too, which gloo refuses with this warning and its default options: of those, only the timeout
        # matters, and it is set below.
        warnings.filterwarnings("ignore", message=r"Tried to pass options to ProcessGroupGloo::split")
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        groups = [mesh.get_group(name) for name in names]
        if tp_degree > 1:
            # A tensor spread over both the shard and tp dimensions (a gradient, for its norm) is reduced over the
            # two in one collective only where that group exists: otherwise DTensor reduces over one dimension, then
            # the other, which warns on every rank, and the ranks may round the sum in different orders.
            groups.append(mesh[("shard", TP_DIM)]._flatten(f"shard_{TP_DIM}").get_group())
    _give_the_run_timeout(groups)
    return mesh


def _give_the_run_timeout(groups: list[dist.ProcessGroup]) -> None:
    """Give sub-groups the default group's timeout (``distributed_timeout_s``). torch makes a mesh's sub-groups
    with its own default, 30 minutes (10 for NCCL), whatever the default group was started with."""
    default = dist.distributed_c10d._get_default_group()
    timeouts = [getattr(getattr(default._get_backend(device), "options", None), "_timeout", None)
                for device in default._device_types]
    timeout = next((timeout for timeout in timeouts if timeout is not None), None)
    if timeout is None:
        return  # a backend without one (torch's fake process group, which simulates a world)
    for group in groups:
        if group is not default:
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions of ``mesh`` that FSDP2 shards (and HSDP replicates) over: all but ``tp``."""
    names = mesh.mesh_dim_names or ()
    if TP_DIM not in names:
        return mesh
    rest = tuple(name for name in names if name != TP_DIM)
    return mesh[rest] if len(rest) > 1 else mesh[rest[0]]

