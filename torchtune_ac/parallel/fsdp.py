"""FSDP2 applied to a model: each transformer block, then the family's other shard groups, then the root, over a
device mesh of the run's device, with mixed precision and the memory features' options (CPU offload's
``offload_policy``). The ``fsdp.*`` keys are ``FSDPConfig``; the order in which a run applies FSDP2 among the
other steps is ``run/assemble.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from torchtune_ac.config_key import config_key
from torchtune_ac.models.families import expert_modules, shard_groups, transformer_blocks
from torchtune_ac.parallel.tensor_parallel import sum_replicated_gradients_in_reduce_dtype
from torchtune_ac.runtime.dtypes import DType
from torchtune_ac.runtime.parallelism import (
    EP_DIM,
    EXPERT_SHARD_DIM,
    TP_DIM,
    data_parallel_mesh,
    expert_data_parallel_mesh,
)


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


def shard_model(model: nn.Module, mesh: DeviceMesh, fsdp: FSDPConfig = FSDPConfig(),
                options: Mapping[str, Any] = {}, *, dtype: DType, frozen: bool = False) -> None:
    """Apply FSDP2 (``fully_shard``) to each transformer block of ``model``, then to the family's other shard
    groups (the embeddings; the final norm with the output layer), then to the root, in place, over a device mesh
    of the run's device (``Parallelism.build_mesh``).

    Call after activation checkpointing (and compile) are applied and before weights are loaded; parameters
    become DTensors sharded on dim 0 over the mesh's ``shard`` dimension (and replicated over its ``replicate`` dimension with ``fsdp.replicate_degree`` > 1: HSDP).

    Args:
        model: a model of a known family, or one with a ``layers`` ``nn.ModuleList`` of blocks.
        mesh: the run's mesh (``Parallelism.build_mesh``, built once per run): FSDP2 shards over all its dimensions
            but ``tp`` (a tensor-parallel run has split the model over ``tp`` first); an expert-parallel run's
            experts, split over ``ep`` first, over ``expert_shard`` (and ``replicate``).
        fsdp: resharding after forward, the mixed-precision dtypes of gathered parameters and of the gradient
            reduce-scatter, and the replicate degree.
        options: more ``fully_shard`` keyword arguments, as the memory switches give them (``offload_policy``).
        dtype: the parameters' storage dtype (the reduce dtype's default).
        frozen: a model that never runs backward (DPO's reference): every group, the root and the last included,
            reshards after its forward. (FSDP2 leaves a group that does not reshard after forward gathered until
            its backward; with no backward, for the rest of the run: on Llama 3 8B, the embedding and the output
            layer whole on every rank.)
    """
    dense_mesh = data_parallel_mesh(mesh)
    common = dict(mesh=dense_mesh, mp_policy=mixed_precision_policy(fsdp, dtype), **options)
    if EP_DIM in (mesh.mesh_dim_names or ()):
        # Expert parallelism split each layer's experts over "ep": each process's share is sharded over the
        # processes that hold the same experts, a group of its own inside its block's. Each expert's gradient
        # already sums its whole expert-parallel group's tokens (the all-to-all's backward), so it is divided by
        # every data-parallel process, as the dense layers' are, not only by those it is reduced over.
        for experts in expert_modules(model):
            fully_shard(experts, **{**common, "mesh": expert_data_parallel_mesh(mesh)},
                        reshard_after_forward=fsdp.reshard_after_forward or frozen)
            experts.set_gradient_divide_factor(float(dense_mesh.size()))
            if mesh.device_type == "cpu" and mesh[EXPERT_SHARD_DIM].size() > 1:
                # A divisor other than the group's size makes the reduce-scatter a pre-multiplied sum, which gloo
                # does not have: a sum then a division instead. (Not over a group of one, which FSDP2 divides
                # without a collective, and would divide again after the sum: torch 2.13.)
                experts.set_force_sum_reduction_for_comms(True)
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
