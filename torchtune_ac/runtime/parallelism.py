"""How a run's processes split the work: one value, ``Parallelism``, resolved once into the run's plan, and the
device mesh it describes.

    world = replicate x shard x tensor           (expert and context: room for the next two, 1 today)

The degrees are checked against the world size here and only here (the model's own limits, heads and widths, are
checked where the run is resolved: ``run/plan.py``'s ``resolve_parallelism``). Everything below the run layer is
handed this value, or the process context; nothing asks torch for the world size or a rank to decide a layout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtune_ac.errors import UserError

REPLICATE_DIM, SHARD_DIM, TP_DIM = "replicate", "shard", "tp"  # the device mesh's dimension names, outermost first


@dataclass(frozen=True)
class Parallelism:
    """The degrees of a run's parallelism, checked against its world size once, when the value is made.

    Ranks are laid out row-major over the mesh ``(replicate, shard, tp)``: the ``tensor`` consecutive ranks of a
    tensor-parallel group (the GPUs of one node) share one batch, so the data is split over
    ``data_parallel_size`` groups, not over the ranks.

    Attributes:
        world_size: processes (None: not known, as for ``tune validate`` or an elastic node range).
        replicate: HSDP's replicas (``fsdp.replicate_degree``); 1: plain FSDP.
        tensor: processes each layer is split over (``tensor_parallel_dim``); 1: none.
        expert: processes a layer's experts are split over; 1 (no key sets it yet).
        context: processes a sequence is split over; 1 (no key sets it yet).

    Raises:
        UserError: a degree below 1, or a world size that is not whole replicas of whole tensor-parallel groups,
            in one line naming the keys and the numbers.
    """

    world_size: Optional[int] = 1
    replicate: int = 1
    tensor: int = 1
    expert: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        for key, degree in (("fsdp.replicate_degree", self.replicate), ("tensor_parallel_dim", self.tensor),
                            ("expert", self.expert), ("context", self.context)):
            if degree < 1:
                raise UserError(f"{key}={degree}: must be at least 1")
        if self.world_size is None or self.world_size % (self.replicate * self.tensor * self.context) == 0:
            return
        if self.tensor == 1:
            raise UserError(
                f"fsdp.replicate_degree={self.replicate}: the world size ({self.world_size} process(es)) must be a "
                "multiple of it (each replica shards the model over world size / replicate_degree processes)")
        raise UserError(
            f"tensor_parallel_dim={self.tensor}, fsdp.replicate_degree={self.replicate}: the world size "
            f"({self.world_size} process(es)) must be a multiple of their product ({self.replicate * self.tensor}): "
            "it is replicate x shard x tensor-parallel processes")

    @property
    def shard(self) -> Optional[int]:
        """Processes FSDP2 shards each parameter over (None when the world size is not known)."""
        return None if self.world_size is None else self.world_size // (self.replicate * self.tensor * self.context)

    @property
    def data_parallel_size(self) -> Optional[int]:
        """How many shares each global batch is split into: the tensor-parallel groups (None: world size unknown)."""
        return None if self.world_size is None else self.world_size // self.tensor

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor > 1

    @property
    def multi_process(self) -> bool:
        """More than one process (a world size not known counts as several: it is a launch's)."""
        return self.world_size is None or self.world_size > 1

    def data_parallel_rank(self, rank: int) -> int:
        """Which share of each global batch ``rank`` reads: its tensor-parallel group's index."""
        return rank // self.tensor

    def speaks_for_its_group(self, rank: int) -> bool:
        """Whether ``rank`` is the first of its tensor-parallel group (the one that counts the group's batch where
        the ranks' results are summed)."""
        return rank % self.tensor == 0

    @property
    def mesh_shape(self) -> Optional[dict[str, int]]:
        """The device mesh's dimensions and sizes, outermost first (``replicate`` only with HSDP, ``tp`` only with
        tensor parallelism); None when the world size is not known."""
        if self.world_size is None:
            return None
        shape = {REPLICATE_DIM: self.replicate} if self.replicate > 1 else {}
        shape[SHARD_DIM] = self.shard
        if self.tensor > 1:
            shape[TP_DIM] = self.tensor
        return shape

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The run's device mesh (``mesh_shape``), of ``device_type`` (the run's device, not whichever accelerator
        the machine has: ``device: cpu`` on a GPU host must shard over gloo). Build it once per run: every model of
        the run (DPO's reference too) is sharded over the same one, so its process groups are made once.

        Consecutive ranks share a row of HSDP (with one node per row the shard collectives stay in a node) and a
        tensor-parallel group. FSDP2 shards over the mesh without ``tp`` (``data_parallel_mesh``). Every group of
        the mesh waits as long as the default group (``distributed_timeout_s``).
        """
        shape = self.mesh_shape
        if shape is None:
            raise ValueError("a device mesh needs a known world size")
        names = tuple(shape)
        with warnings.catch_warnings():
            # On CUDA, torch splits each sub-group from the default group and hands the NCCL side's options to the
            # gloo side too, which gloo refuses with this warning and its default options: of those, only the
            # timeout matters, and it is set below.
            warnings.filterwarnings("ignore", message=r"Tried to pass options to ProcessGroupGloo::split")
            mesh = init_device_mesh(device_type, tuple(shape.values()), mesh_dim_names=names)
            groups = [mesh.get_group(name) for name in names]
            if self.tensor > 1:
                # A tensor spread over both the shard and tp dimensions (a gradient, for its norm) is reduced over
                # the two in one collective only where that group exists: otherwise DTensor reduces over one
                # dimension, then the other, which warns on every rank, and the ranks may round the sum in
                # different orders.
                groups.append(mesh[(SHARD_DIM, TP_DIM)]._flatten(f"{SHARD_DIM}_{TP_DIM}").get_group())
        _give_the_run_timeout(groups)
        return mesh

    def describe_processes(self) -> str:
        """The world and how it is split, for messages: ``4 process(es) (2 replicas x 2 shards, HSDP)``."""
        if self.world_size is None:
            return "the launch's processes"
        tp = f" x TP {self.tensor}" if self.tensor > 1 else ""
        if self.replicate == 1:
            return f"{self.world_size} process(es)" + (f" ({self.shard} shards{tp})" if tp else "")
        return f"{self.world_size} process(es) ({self.replicate} replicas x {self.shard} shards{tp}, HSDP)"


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
