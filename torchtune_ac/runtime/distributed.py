"""Processes, devices and FSDP2 sharding.

A single process is a world of size 1: the same functions run, they just skip the collectives. Under
PyTorch's elastic launcher (``tune run --nproc_per_node N``) the process group is initialised from the
environment it sets: on CUDA NCCL for CUDA tensors with gloo beside it for CPU tensors, on CPU gloo.

Host-side collectives run on gloo, never NCCL: torch sends object collectives (``broadcast_object_list``,
``all_gather_object``, which the checkpoint code, the output lock and the config agreement use) to a group's CPU
backend when it has one, and ``barrier``/``host_barrier`` here (and the checkpoint package's) reduce a CPU
tensor, since ``dist.barrier()`` on a group bound to a GPU runs on NCCL. While rank 0 alone writes, fsyncs and
prunes a checkpoint, the others wait there, where NCCL's watchdog does not look; every wait is bounded by the
group's ``timeout`` (``distributed_timeout_s``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.models.families import shard_groups, transformer_blocks
from torchtune_ac.runtime.dtypes import DType

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2 settings (the ``fsdp.*`` config keys), used when the run has more than one process."""

    # Free each block's gathered parameters after its forward (saves memory, re-gathers in backward). The
    # metadata names torchtune's key for it (tune migrate reads it).
    reshard_after_forward: bool = field(default=True, metadata={"torchtune": "fsdp_reshard_after_forward"})
    # Mixed precision: dtype of the gathered parameters used in forward/backward (null: same as `dtype`).
    param_dtype: Optional[DType] = None
    # dtype of the gradient reduce-scatter (null: the storage dtype `dtype`, so bf16 gradients are not upcast to
    # fp32 for the collective and cast back; fp32 sums in fp32 at twice the bytes).
    reduce_dtype: Optional[DType] = None
    # HSDP: processes are a (replicate, shard) grid; parameters are sharded over the shard_degree processes of a
    # row (world size / replicate_degree) and replicated over the rows (1: plain FSDP over every process).
    replicate_degree: int = field(default=1, metadata={"minimum": 1, "torchtune": "data_parallel_replicate_dim"})

    def resolved_reduce_dtype(self, dtype: DType) -> DType:
        """The reduce-scatter's dtype for parameters stored in ``dtype``."""
        return self.reduce_dtype if self.reduce_dtype is not None else dtype

    def shard_degree(self, world_size: int) -> int:
        """Processes each parameter is sharded over: ``world_size / replicate_degree``.

        Raises:
            UserError: ``world_size`` is not a multiple of ``replicate_degree``.
        """
        check_replicate_degree(self.replicate_degree, world_size)
        return world_size // self.replicate_degree


def check_replicate_degree(replicate_degree: int, world_size: int) -> None:
    """Raise ``UserError`` unless ``world_size`` processes form whole rows of ``replicate_degree``."""
    if world_size % replicate_degree:
        raise UserError(
            f"fsdp.replicate_degree={replicate_degree}: the world size ({world_size} process(es)) must be a multiple "
            "of it (each replica shards the model over world size / replicate_degree processes)"
        )


@dataclass(frozen=True)
class DistributedContext:
    """Who this process is: rank, world size, and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


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


def barrier(ctx: DistributedContext) -> None:
    """Wait until every rank gets here (``host_barrier``); nothing in a world of one."""
    if ctx.is_distributed:
        host_barrier()


def host_barrier() -> None:
    """Wait on the host until every rank of the default process group gets here, over gloo.

    A sum of a CPU tensor, which the group hands to its CPU backend (gloo, beside NCCL on CUDA): ``dist.barrier()``
    on a group bound to a GPU would run on NCCL, whose watchdog then counts rank 0's checkpoint writing against
    the others. Bounded by the group's timeout.
    """
    dist.all_reduce(torch.zeros(1))


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


def build_device_mesh(device_type: str, world_size: int, replicate_degree: int = 1) -> DeviceMesh:
    """The device mesh FSDP2 shards over, of ``device_type`` (the run's device, not whichever accelerator the
    machine has: ``device: cpu`` on a GPU host must shard over gloo on the CPU).

    Args:
        device_type: ``cpu`` or ``cuda``.
        world_size: processes in the default process group (1: a world of one).
        replicate_degree: 1 for a 1-D mesh ``("shard",)`` over every process; more for HSDP's 2-D mesh
            ``("replicate", "shard")`` of ``replicate_degree`` rows of ``world_size / replicate_degree`` processes
            (consecutive ranks share a row, so with one node per row the shard collectives stay inside a node).

    Raises:
        UserError: ``world_size`` is not a multiple of ``replicate_degree``.
    """
    check_replicate_degree(replicate_degree, world_size)
    if replicate_degree == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicate_degree, world_size // replicate_degree),
                            mesh_dim_names=("replicate", "shard"))


def mixed_precision_policy(fsdp: FSDPConfig, dtype: DType) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for parameters stored in ``dtype``: gathered in ``fsdp.param_dtype`` (null: as
    stored), gradients reduced in ``fsdp.reduce_dtype`` (null: as stored)."""
    return MixedPrecisionPolicy(
        param_dtype=fsdp.param_dtype.torch if fsdp.param_dtype is not None else None,
        reduce_dtype=fsdp.resolved_reduce_dtype(dtype).torch,
    )


def parameter_device(options: Mapping[str, Any], device: torch.device) -> torch.device:
    """Where a sharded model's parameters are allocated: the CPU when ``options`` (``fully_shard`` arguments) keep
    the shards there (``CPUOffloadPolicy``: FSDP2 copies each to ``device`` when it gathers it), else ``device``."""
    return torch.device("cpu") if isinstance(options.get("offload_policy"), CPUOffloadPolicy) else device


def shard_model(model: nn.Module, fsdp: FSDPConfig = FSDPConfig(), options: Mapping[str, Any] = {}, *,
                device: torch.device, dtype: DType) -> DeviceMesh:
    """Apply FSDP2 (``fully_shard``) to each transformer block of ``model``, then to the family's other shard
    groups (the embeddings; the final norm with the output layer), then to the root, in place, over a device mesh
    of ``device``'s type.

    Call after activation checkpointing (and compile) are applied and before weights are loaded, with the default
    process group initialised; parameters become DTensors sharded on dim 0 over the mesh's ``shard`` dimension
    (and replicated over its ``replicate`` dimension with ``fsdp.replicate_degree`` > 1: HSDP).

    Args:
        model: a model of a known family, or one with a ``layers`` ``nn.ModuleList`` of blocks.
        fsdp: resharding after forward, the mixed-precision dtypes of gathered parameters and of the gradient
            reduce-scatter, and the replicate degree.
        options: more ``fully_shard`` keyword arguments, as the memory switches give them (``offload_policy``).
        device: the device the run computes on (its type is the mesh's).
        dtype: the parameters' storage dtype (the reduce dtype's default).

    Returns:
        The mesh the model is sharded over.

    Raises:
        UserError: the world size is not a multiple of ``fsdp.replicate_degree``.
    """
    mesh = build_device_mesh(device.type, dist.get_world_size(), fsdp.replicate_degree)
    common = dict(mesh=mesh, mp_policy=mixed_precision_policy(fsdp, dtype), **options)
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=fsdp.reshard_after_forward, **common)
    groups = shard_groups(model)
    for index, group in enumerate(groups):
        # The last group runs last in forward and first in backward: resharding it would only re-gather it.
        last = index == len(groups) - 1
        fully_shard(list(group), reshard_after_forward=fsdp.reshard_after_forward and not last, **common)
    # The root holds what no group does (a tied embedding and output, a custom model's embeddings and head): used
    # first and last in forward, resharding it after forward would only re-gather it at once for backward.
    fully_shard(model, reshard_after_forward=False, **common)
    return mesh


def offloaded_gradient_wait(model: nn.Module) -> Optional[Callable[[torch.Tensor], None]]:
    """A function that waits until FSDP2 has copied one parameter's reduced gradient into host memory, for a hook
    that reads the gradient in backward (the optimizer step in backward); None when no parameter of ``model`` is
    offloaded (``fsdp.cpu_offload``).

    Why: with ``CPUOffloadPolicy`` FSDP2 starts a non-blocking copy of each reduced gradient into pinned host
    memory and records an event for it (``FSDPParam.grad_offload_event``). Before torch 2.12 it then calls the
    parameter's post-accumulate-grad hooks at once, and waits for the copy only when backward ends
    (pytorch/pytorch#180666), so a hook would step on memory still in flight. Waiting on that one event costs the
    hook no more than the copy of its own gradient. torch 2.12 and newer copy synchronously when a parameter has
    hooks, and record no event: then this waits for nothing.
    """
    offloaded: dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group is not None else ():
            if fsdp_param.offload_to_cpu:
                offloaded[id(fsdp_param.sharded_param)] = fsdp_param
    if not offloaded:
        return None

    def wait(param: torch.Tensor) -> None:
        fsdp_param = offloaded.get(id(param))
        event = fsdp_param.grad_offload_event if fsdp_param is not None else None
        if event is not None:
            event.synchronize()

    return wait
