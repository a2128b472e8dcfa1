"""FSDP2 applied to a model: each transformer block, then the family's other shard groups, then the root, over a
device mesh of the run's device, with mixed precision and the memory features' options (CPU offload's
``offload_policy``). The ``fsdp.*`` keys are ``runtime.distributed.FSDPConfig``; the order in which a run applies
FSDP2 among the other steps is ``run/assemble.py``'s.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtune_ac.models.families import shard_groups, transformer_blocks
from torchtune_ac.runtime.distributed import TP_DIM, FSDPConfig, build_device_mesh, data_parallel_mesh
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.training.tensor_parallel import sum_replicated_gradients_in_reduce_dtype


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
                device: torch.device, dtype: DType, frozen: bool = False,
                mesh: Optional[DeviceMesh] = None) -> DeviceMesh:
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
        frozen: a model that never runs backward (DPO's reference): every group, the root and the last included,
            reshards after its forward. (FSDP2 leaves a group that does not reshard after forward gathered until
            its backward; with no backward, for the rest of the run: on Llama 3 8B, the embedding and the output
            layer whole on every rank.)
        mesh: the run's mesh (``build_device_mesh``) when it was built before: a tensor-parallel run splits the
            model over its ``tp`` dimension first, and FSDP2 shards over the others. None: one is built here.

    Returns:
        The mesh the model is sharded over (the run's mesh, ``tp`` included).

    Raises:
        UserError: the world size is not a multiple of ``fsdp.replicate_degree``.
    """
    if mesh is None:
        mesh = build_device_mesh(device.type, dist.get_world_size(), fsdp.replicate_degree)
    common = dict(mesh=data_parallel_mesh(mesh), mp_policy=mixed_precision_policy(fsdp, dtype), **options)
    for block in transformer_blocks(model):
        fully_shard(block, reshard_after_forward=fsdp.reshard_after_forward or frozen, **common)
    groups = shard_groups(model)
    for index, group in enumerate(groups):
        # The last group runs last in forward and first in backward: resharding it would only re-gather it.
        last = index == len(groups) - 1
        fully_shard(list(group), reshard_after_forward=(fsdp.reshard_after_forward and not last) or frozen, **common)
    # The root holds what no group does (a tied embedding and output, a custom model's embeddings and head): used
    # first and last in forward, resharding it after forward would only re-gather it at once for backward.
    fully_shard(model, reshard_after_forward=frozen, **common)
    if TP_DIM in (mesh.mesh_dim_names or ()):
        sum_replicated_gradients_in_reduce_dtype(model, TP_DIM)
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
