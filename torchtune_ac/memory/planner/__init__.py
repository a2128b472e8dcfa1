"""Will it fit? The memory per process of a training step, for every activation checkpointing setting.

Method: simulate, not guess. The real model and the recipe's own step (``accumulate_gradients`` then
``update_parameters``: forward, loss, backward with AC recompute, clipping, the optimizer step, or the step in
backward) run under ``FakeTensorMode``: tensors carry shapes and dtypes but no data and no memory, and kernels
are chosen as on a CPU (flash attention without a mask; CUDA's fused kernels keep the same output and log-sum-
exp). A dispatch mode records every tensor storage the step allocates and when it is freed, so the estimate
follows the step's real sequence of allocations: activations saved for backward, per-op AC caches, a block's
recompute, the logits or the chunked loss, gradients, the optimizer's temporaries. Parameters, optimizer
state and the batch exist before the step and are counted from their sizes.

Deep models are simulated shallower. The step is split into phases (forward, the loss's backward, the blocks'
backward, the rest of backward, the optimizer step) and each phase's peak is recorded; every block is alike,
so each phase's peak grows linearly with the number of blocks. The planner simulates two depths that repeat
the plan's pattern (2 and 4 blocks, or k and 2k for every k-th block) and extrapolates each phase to the
model's depth; the step's peak is the largest phase. A model no deeper than the second depth is simulated
whole. ``tests/unit/memory/test_planner.py`` checks the extrapolation against whole-depth simulation.

Compiled blocks (``compile: true``): a block without AC runs as AOTAutograd's forward and backward graphs, traced
and partitioned as inductor partitions them, op by op (``_CompiledForward``): the step keeps what the compiled block
saves, fewer tensors than eager.

Several processes (FSDP2): the simulation runs one process's batch; parameters, optimizer state and gradients
are divided by the world size, and what FSDP2 adds is counted from the model's sizes: the root's parameters
stay gathered through forward and backward (``reshard_after_forward`` is false for the root), two blocks'
gathered parameters (the one running and the one prefetched; every block when
``fsdp.reshard_after_forward`` is false), and one block's unsharded gradients in the reduce dtype.

Expert parallelism (``experts.py``): the simulated process holds its ``E / ep`` experts of each MoE layer and sends
its rows through the all-to-alls on fake tensors, receiving ``ROUTED_ROWS_MARGIN`` times a balanced router's share;
its experts' gradients are sharded over ``expert_shard``, the whole model's state over ``shard`` as without it,
and FSDP2 gathers only its own experts, in a group of their own (docs/moe.md, "Planning memory").

Assumptions (``tune plan`` prints them): every position of every row is a target (the loss's worst case),
rows are ``max_seq_len`` long, parameters compute in their storage dtype (FSDP mixed precision is not
modelled), and memory an allocator keeps beyond live tensors (fragmentation, caching) is not included.
"""

from torchtune_ac.memory.planner.workload import (
    GiB,
    ROUTED_ROWS_MARGIN,
    STRIDES,
    PHASES,
    BACKWARD_PHASES,
    ImageLoad,
    PreferenceStep,
    Workload,
    MemoryEstimate,
    describe_setting,
    candidate_plans,
)
from torchtune_ac.memory.planner.estimate import (
    in_backward_stream_pool,
    tensor_parallel_share,
    estimate_memory,
)
from torchtune_ac.memory.planner.search import (
    suggested_tensor_parallel_degree,
    switch_ablation,
    choose_plan,
)

__all__ = [
    "BACKWARD_PHASES",
    "GiB",
    "ImageLoad",
    "MemoryEstimate",
    "PHASES",
    "PreferenceStep",
    "ROUTED_ROWS_MARGIN",
    "STRIDES",
    "Workload",
    "candidate_plans",
    "describe_setting",
    "estimate_memory",
    "in_backward_stream_pool",
    "tensor_parallel_share",
    "choose_plan",
    "suggested_tensor_parallel_degree",
    "switch_ablation",
]
