"""How a run's processes split the work: one value, ``Parallelism``, resolved once into the run's plan, and the
device mesh it describes.

    world = replicate x shard x tensor           (context: room for the next one, 1 today)
    shard = expert_shard x expert                (expert parallelism splits FSDP's shard dimension)

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

# The device mesh's dimension names, outermost first. With expert parallelism the mesh is built as
# (replicate, expert_shard, ep) and "shard" is the flattened (expert_shard, ep): FSDP2 shards the dense layers over
# "shard", and each layer's experts, split over "ep", over "expert_shard" (the ranks that hold the same experts).
REPLICATE_DIM, SHARD_DIM, TP_DIM = "replicate", "shard", "tp"
EXPERT_SHARD_DIM, EP_DIM = "expert_shard", "ep"


@dataclass(frozen=True)
class Parallelism:
    """The degrees of a run's parallelism, checked against its world size once, when the value is made.

    Ranks are laid out row-major over the mesh ``(replicate, shard, tp)``: the ``tensor`` consecutive ranks of a
    tensor-parallel group (the GPUs of one node) share one batch, so the data is split over
    ``data_parallel_size`` groups, not over the ranks. Expert parallelism does not change the data's split: the
    ``expert`` consecutive ranks of an expert-parallel group each read their own share, and send each token to the
    rank that holds its expert (``parallel/expert_parallel.py``).

    Attributes:
        world_size: processes (None: not known, as for ``tune validate`` or an elastic node range).
        replicate: HSDP's replicas (``fsdp.replicate_degree``); 1: plain FSDP.
        tensor: processes each layer is split over (``tensor_parallel_dim``); 1: none.
        expert: processes a layer's experts are split over (``expert_parallel_dim``); 1: none. It splits the
            shard dimension: the experts are sharded by FSDP2 over the ``expert_shard`` processes that hold the
            same experts.
        context: processes a sequence is split over; 1 (no key sets it yet).

    Raises:
        UserError: a degree below 1, a world size that is not whole replicas of whole tensor-parallel groups,
            an expert degree that does not divide each replica's processes, or expert and tensor parallelism
            together, in one line naming the keys and the numbers.
    """

    world_size: Optional[int] = 1
    replicate: int = 1
    tensor: int = 1
    expert: int = 1
    context: int = 1

    def __post_init__(self) -> None:
        for key, degree in (("fsdp.replicate_degree", self.replicate), ("tensor_parallel_dim", self.tensor),
                            ("expert_parallel_dim", self.expert), ("context", self.context)):
            if degree < 1:
                raise UserError(f"{key}={degree}: must be at least 1")
        if self.expert > 1 and self.tensor > 1:
            raise UserError(f"expert_parallel_dim={self.expert} with tensor_parallel_dim={self.tensor}: a mixture of "
                            "experts does not run under tensor parallelism; use tensor_parallel_dim: 1")
        if self.world_size is None or self.world_size % (self.replicate * self.tensor * self.context) == 0:
            if self.expert > 1 and self.shard is not None and self.shard % self.expert:
                raise UserError(
                    f"expert_parallel_dim={self.expert}: must divide the processes each replica shards over (world "
                    f"size {self.world_size} / fsdp.replicate_degree {self.replicate} = {self.shard})")
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
    def expert_shard(self) -> Optional[int]:
        """Processes FSDP2 shards each expert over: those of a replica that hold the same experts (None when the
        world size is not known)."""
        return None if self.shard is None else self.shard // self.expert

    @property
    def expert_parallel(self) -> bool:
        return self.expert > 1

    @property
    def data_parallel_size(self) -> Optional[int]:
        """How many shares each global batch is split into: the tensor-parallel groups (None: world size unknown)."""
        return None if self.world_size is None else self.world_size // self.tensor

    @property
    def tensor_parallel(self) -> bool:
        return self.tensor > 1

    @property
    def fewest_processes(self) -> int:
        """The smallest world size these degrees run on: one of each (an expert-parallel group within one
        replica's shards, a tensor-parallel group within one shard)."""
        return self.replicate * self.tensor * self.expert * self.context

    def describe_degrees(self) -> str:
        """The degrees above 1, as the config's keys: ``expert_parallel_dim=8`` (empty when there are none)."""
        return ", ".join(f"{key}={degree}" for key, degree in (
            ("fsdp.replicate_degree", self.replicate), ("tensor_parallel_dim", self.tensor),
            ("expert_parallel_dim", self.expert)) if degree > 1)

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
        tensor parallelism, ``expert_shard`` and ``ep`` in place of ``shard`` with expert parallelism: ``shard`` is
        then their flattening); None when the world size is not known."""
        if self.world_size is None:
            return None
        shape = {REPLICATE_DIM: self.replicate} if self.replicate > 1 else {}
        if self.expert > 1:
            shape[EXPERT_SHARD_DIM] = self.expert_shard
            shape[EP_DIM] = self.expert
            return shape
        shape[SHARD_DIM] = self.shard
        if self.tensor > 1:
            shape[TP_DIM] = self.tensor
        return shape

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The run's device mesh (``mesh_shape``), of ``device_type`` (the run's device, not whichever accelerator
        the machine has: ``device: cpu`` on a GPU host must shard over gloo). Build it once per run: every model of
        the run (DPO's reference too) is sharded over the same one, so its process groups are made once.

        Consecutive ranks share a row of HSDP (with one node per row the shard collectives stay in a node), a
        tensor-parallel group and an expert-parallel group (the all-to-alls stay in a node). FSDP2 shards over the
        mesh without ``tp`` (``data_parallel_mesh``), the experts over ``expert_shard``
        (``expert_data_parallel_mesh``). Every group of the mesh waits as long as the default group
        (``distributed_timeout_s``).
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
            if self.expert > 1:
                # The dense layers shard over every process of a replica: the two dimensions as one.
                groups.append(mesh[(EXPERT_SHARD_DIM, EP_DIM)]._flatten(SHARD_DIM).get_group())
        _give_the_run_timeout(groups)
        return mesh

    def describe_processes(self) -> str:
        """The world and how it is split, for messages: ``4 process(es) (2 replicas x 2 shards, HSDP)``."""
        if self.world_size is None:
            return "the launch's processes"
        tp = f" x TP {self.tensor}" if self.tensor > 1 else (f", EP {self.expert}" if self.expert > 1 else "")
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
    """The dimensions of ``mesh`` that FSDP2 shards (and HSDP replicates) the dense layers over: all but ``tp``
    (with expert parallelism: ``replicate`` and the flattened ``shard``)."""
    names = mesh.mesh_dim_names or ()
    if EP_DIM in names:
        rest = tuple(name for name in names if name == REPLICATE_DIM) + (SHARD_DIM,)
        with warnings.catch_warnings():
            # torch 2.13 slices a flattened dimension from its root mesh as it always did, and warns that a later
            # release will want the flattened mesh kept instead (``build_mesh`` keeps none: HSDP's dense mesh is
            # (replicate, shard), a slice either way).
            warnings.filterwarnings("ignore", message=r"Slicing a flattened dim from root mesh")
            return mesh[rest] if len(rest) > 1 else mesh[rest[0]]
    if TP_DIM in names:
        rest = tuple(name for name in names if name != TP_DIM)
    else:
        return mesh
    return mesh[rest] if len(rest) > 1 else mesh[rest[0]]


def expert_data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions of an expert-parallel ``mesh`` that FSDP2 shards (and HSDP replicates) the experts over:
    ``replicate`` and ``expert_shard``, the processes that hold the same experts."""
    rest = tuple(name for name in mesh.mesh_dim_names or () if name in (REPLICATE_DIM, EXPERT_SHARD_DIM))
    return mesh[rest] if len(rest) > 1 else mesh[rest[0]]
