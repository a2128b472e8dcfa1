"""The mixture-of-experts layer: each token goes to k of a layer's experts, and every expert of the layer runs in
one grouped matmul.

Four steps, each a function of its own so that expert parallelism can shard the experts' leading dimension and
put an all-to-all around ``compute_experts`` (dispatch to the experts' ranks, combine back):

1. ``route``: the router's logits ``[T, E]`` -> each token's k experts and their weights;
2. ``dispatch``: the tokens' copies ``[T * k, dim]`` sorted by expert, with the number each expert received;
3. ``compute_experts``: every expert's gated MLP over its rows, one grouped matmul per projection
   (``grouped_mm``: ``torch._grouped_mm`` where it runs, else a padded batched matmul);
4. ``combine``: each token's k outputs, weighted and summed, back in token order.

Routing is dropless: every token reaches its k experts, whatever their load (no capacity factor). A family
declares its router (``RouterSpec``) and how its experts' weights are laid out (``ExpertLayout``) as data; the
weights are held in that layout, the Hugging Face one, so they load by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

# How a router turns logits into weights: softmax over every expert then the top k (Qwen3-MoE, Mixtral), or the
# top k logits then a softmax over those k (gpt-oss).
ROUTER_SCORINGS = ("softmax_topk", "topk_softmax")
# The experts' gate activations: SwiGLU (silu), and gpt-oss's clamped SwiGLU (``x * sigmoid(alpha * x)`` on a gate
# clamped above at ``limit``, times ``up + 1`` with up clamped to [-limit, limit]).
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class RouterSpec:
    """A family's router.

    Attributes:
        scoring: one of ``ROUTER_SCORINGS``.
        norm_topk_prob: with ``softmax_topk``, the k weights are divided by their sum (Qwen3-MoE's ``norm_topk_prob``).
        bias: the router's linear layer has a bias (gpt-oss).
    """

    scoring: str = "softmax_topk"
    norm_topk_prob: bool = False
    bias: bool = False


@dataclass(frozen=True)
class ExpertLayout:
    """How a family holds its experts' weights (the Hugging Face layout in memory), and their activation.

    ``gate_up_proj`` holds the gate and up projections of every expert, ``down_proj`` the down projections:

    - ``in_out``: ``[E, in, out]`` (gpt-oss: ``gate_up_proj [E, dim, 2 * expert_dim]``); False: ``[E, out, in]``,
      each expert's as an ``nn.Linear`` holds it (Qwen3-MoE: ``gate_up_proj [E, 2 * expert_dim, dim]``);
    - ``interleaved``: gate and up columns alternate (gpt-oss); False: the gate's half, then the up's;
    - ``bias``: ``gate_up_proj_bias [E, 2 * expert_dim]`` and ``down_proj_bias [E, dim]`` (gpt-oss);
    - ``activation``: one of ``EXPERT_ACTIVATIONS``, with ``swiglu_alpha`` and ``swiglu_limit`` for the clamped one.
    """

    in_out: bool = False
    interleaved: bool = False
    bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


@dataclass(frozen=True)
class MoEArgs:
    """A model's mixture-of-experts layers.

    Attributes:
        num_experts: E, experts per MoE layer.
        top_k: k, experts per token.
        expert_dim: each expert's hidden size (Hugging Face ``moe_intermediate_size``).
        router: the router.
        experts: the experts' layout and activation.
        sparse_step: every ``sparse_step``-th layer is an MoE layer (``decoder_sparse_step``), but those in
            ``dense_layers`` (``mlp_only_layers``), which keep the dense MLP.
        dense_layers: layers with the dense MLP whatever ``sparse_step`` says.
        aux_loss: add the load-balancing loss to the objective (Hugging Face ``output_router_logits``).
        aux_loss_coef: its weight (``router_aux_loss_coef``).
    """

    num_experts: int
    top_k: int
    expert_dim: int
    router: RouterSpec = RouterSpec()
    experts: ExpertLayout = ExpertLayout()
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()
    aux_loss: bool = False
    aux_loss_coef: float = 0.001

    def problems(self) -> list[str]:
        """What is wrong with these arguments (empty when nothing is)."""
        problems = []
        for name in ("num_experts", "top_k", "expert_dim", "sparse_step"):
            if getattr(self, name) <= 0:
                problems.append(f"moe.{name}={getattr(self, name)} must be positive")
        if self.top_k > self.num_experts > 0:
            problems.append(f"moe.top_k={self.top_k} must be at most num_experts={self.num_experts}")
        if self.router.scoring not in ROUTER_SCORINGS:
            problems.append(f"moe.router.scoring={self.router.scoring!r} must be one of {', '.join(ROUTER_SCORINGS)}")
        if self.experts.activation not in EXPERT_ACTIVATIONS:
            problems.append(f"moe.experts.activation={self.experts.activation!r} must be one of "
                            f"{', '.join(EXPERT_ACTIVATIONS)}")
        if not self.aux_loss_coef >= 0 or math.isinf(self.aux_loss_coef):
            problems.append(f"moe.aux_loss_coef={self.aux_loss_coef} must be a finite number, not negative")
        return problems

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` is an MoE layer (as transformers' Qwen3-MoE decides it)."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


# ----------------------------------------------------------------------------------------------------- routing


def route(logits: torch.Tensor, spec: RouterSpec, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and weights, from the router's logits ``[T, E]``.

    Returns:
        ``(weights [T, k] in the logits' dtype, experts [T, k] int64)``.
    """
    if spec.scoring == "topk_softmax":
        top, experts = torch.topk(logits, top_k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), experts
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


@dataclass(frozen=True)
class Dispatch:
    """Where each token's copies went (``dispatch``), for ``compute_experts`` and ``combine``.

    Attributes:
        order: ``[T * k]`` int64: the (token, slot) pair, flattened, that each sorted row is a copy of.
        experts: ``[T * k]`` int64: the expert of each sorted row (ascending).
        counts: ``[E]`` int64: rows each expert received.
    """

    order: torch.Tensor
    experts: torch.Tensor
    counts: torch.Tensor


def dispatch(x: torch.Tensor, experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, Dispatch]:
    """The tokens' copies sorted by expert (stably: within an expert, in token order).

    Args:
        x: ``[T, dim]`` tokens.
        experts: ``[T, k]`` each token's experts.
        num_experts: E.

    Returns:
        ``(rows [T * k, dim], dispatch)``.
    """
    flat = experts.flatten()  # [T * k]
    order = torch.argsort(flat, stable=True)
    # A scatter, not bincount: its shape does not depend on the values (the planner runs this on fake tensors).
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    rows = x.index_select(0, torch.div(order, experts.shape[1], rounding_mode="floor"))  # [T * k, dim]
    return rows, Dispatch(order=order, experts=flat.index_select(0, order), counts=counts)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order``: ``x[order][inverse_permutation(order)]`` is ``x``. Rows are put back by
    gathering with it, not by ``index_copy_`` into ``order``'s places, which keeps its whole source for backward
    (a gather keeps only its indices)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


def combine(rows: torch.Tensor, plan: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs, weighted and summed: ``rows [T * k, dim]`` (sorted by expert) -> ``[T, dim]``."""
    tokens, k = weights.shape
    unsorted = rows.index_select(0, inverse_permutation(plan.order))  # [T * k, dim] in (token, slot) order
    return (unsorted.view(tokens, k, -1) * weights.unsqueeze(-1)).sum(dim=1)


# ------------------------------------------------------------------------------------------- grouped compute


# The experts' kernels: torch's grouped matmul (``torch._grouped_mm``), where it has a kernel of its own, or the
# rows padded to the busiest expert's count and multiplied by one ``torch.bmm``.
GROUPED, PADDED_BMM = "grouped", "padded_bmm"
EXPERT_KERNELS = (GROUPED, PADDED_BMM)
# The CUDA compute capabilities (majors) where torch 2.13's ``_grouped_mm`` has its fast kernel in bfloat16: Hopper
# (sm90) and Blackwell's datacenter parts (sm100). Elsewhere (Ampere, Ada, sm120, and any float32 on CUDA) torch
# runs a loop over the groups with a host synchronisation, and the experts take the padded batched matmul.
GROUPED_MM_CUDA_MAJORS = (9, 10)


def choose_expert_kernel(device_type: str, dtype: torch.dtype, capability: Optional[tuple[int, int]],
                         inner_dims: tuple[int, ...]) -> str:
    """The experts' kernel for a run (one of ``EXPERT_KERNELS``), as torch would run it: grouped on a CPU in float32
    or bfloat16, on CUDA in bfloat16 on ``GROUPED_MM_CUDA_MAJORS``, and where the weights' rows (``inner_dims``,
    every expert weight's last two dimensions) are multiples of 16 bytes (its alignment rule); else padded.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (any other: padded).
        dtype: the experts' compute dtype.
        capability: the CUDA device's compute capability (ignored on a CPU).
        inner_dims: the expert weights' dimensions after the leading one.
    """
    if not hasattr(torch, "_grouped_mm"):
        return PADDED_BMM
    if device_type == "cpu":
        dtype_ok = dtype in (torch.float32, torch.bfloat16)
    elif device_type == "cuda":
        dtype_ok = dtype == torch.bfloat16 and capability is not None and capability[0] in GROUPED_MM_CUDA_MAJORS
    else:
        dtype_ok = False
    aligned = all((d * dtype.itemsize) % 16 == 0 for d in inner_dims)
    return GROUPED if dtype_ok and aligned else PADDED_BMM


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, kernel: str = GROUPED) -> torch.Tensor:
    """Every expert's rows times its weight, in one call: ``x [N, K]`` (rows sorted by expert, ``counts[e]`` of
    expert e) times ``weight [E, K, M]`` -> ``[N, M]``, by ``kernel`` (``choose_expert_kernel``).

    Grouped: ``torch._grouped_mm``, in float32 through ``torchtune_ac::grouped_mm`` (the same kernel, with a shape
    function that takes float32, which ``torch.compile`` and the planner's fake tensors trace; torch's own takes
    bfloat16 only). Padded: the rows padded to the busiest expert's count and multiplied by one ``torch.bmm``,
    which reads that count on the host.
    """
    if kernel == GROUPED:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        if x.dtype == torch.bfloat16:
            return torch._grouped_mm(x.contiguous(), weight, offs=offsets)
        return grouped_mm_op(x.contiguous(), weight, offsets)
    return _padded_bmm(x, weight, counts)


@torch.library.custom_op("torchtune_ac::grouped_mm", mutates_args=())
def grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offsets)``: ``[N, K] x [E, K, M] -> [N, M]``, or ``[K, N] x [N, M] ->
    [E, K, M]`` (groups along N: the weights' gradient)."""
    return torch._grouped_mm(a, b, offs=offsets)


@grouped_mm_op.register_fake
def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[-1])


def _grouped_mm_setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    a, b, offsets = ctx.saved_tensors  # the forward's [N, K] x [E, K, M] (the only form it is called with)
    grad_a = grouped_mm_op(grad, b.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None  # [N, K]
    grad_b = grouped_mm_op(a.t(), grad, offsets) if ctx.needs_input_grad[1] else None  # [E, K, M]
    return grad_a, grad_b, None


grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    num_experts, n = weight.shape[0], x.shape[0]
    expert = torch.repeat_interleave(torch.arange(num_experts, device=x.device), counts, output_size=n)  # [N]
    starts = torch.cumsum(counts, 0) - counts  # [E]
    slot = torch.arange(n, device=x.device) - starts[expert]  # [N]: the row's place within its expert
    width = int(counts.max()) if n else 0
    padded = x.new_zeros(num_experts, width, x.shape[1]).index_put((expert, slot), x)  # [E, width, K]
    return torch.bmm(padded, weight)[expert, slot]  # [E, width, M] -> [N, M]


def expert_activation(gate_up: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """The gated hidden state ``[N, expert_dim]`` from the gate and up projections ``[N, 2 * expert_dim]``."""
    if layout.interleaved:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if layout.activation == "silu":
        return F.silu(gate) * up
    limit = layout.swiglu_limit
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * layout.swiglu_alpha))


class GroupedExperts(nn.Module):
    """The experts of one MoE layer, their weights stacked on a leading dimension of E (which expert parallelism
    shards), in the family's ``ExpertLayout``."""

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.layout = args.experts
        e, h = args.num_experts, args.expert_dim
        gate_up, down = ((e, dim, 2 * h), (e, h, dim)) if self.layout.in_out else ((e, 2 * h, dim), (e, dim, h))
        self.gate_up_proj = nn.Parameter(torch.empty(gate_up))
        self.down_proj = nn.Parameter(torch.empty(down))
        if self.layout.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * h))
            self.down_proj_bias = nn.Parameter(torch.empty(e, dim))
        else:
            self.gate_up_proj_bias = self.down_proj_bias = None
        # Expert parallelism's exchange (``parallel/expert_parallel.py``), which holds this process's experts only
        # and runs them over the rows other processes send it; None: every expert is here.
        self.exchange: Optional[Callable[[GroupedExperts, torch.Tensor, Dispatch], torch.Tensor]] = None
        # The kernel, chosen once: here for a CPU in the default dtype, again for the run's device and dtype when
        # the model is placed on it (``choose_expert_kernels_``).
        self.kernel = choose_expert_kernel("cpu", torch.get_default_dtype(), None, self.inner_dims)

    @property
    def inner_dims(self) -> tuple[int, ...]:
        """Every expert weight's dimensions after the leading (expert) one."""
        return (*self.gate_up_proj.shape[1:], *self.down_proj.shape[1:])

    def _in_out(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if self.layout.in_out else weight.transpose(1, 2)  # [E, in, out]

    def forward(self, rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
        if self.exchange is not None:
            return self.exchange(self, rows, plan)
        return compute_experts(self, rows, plan)


def compute_experts(experts: GroupedExperts, rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """Every expert's gated MLP over its rows: ``rows [N, dim]`` sorted by expert -> ``[N, dim]``.

    The experts are those this process holds: all of them, or under expert parallelism its share of the leading
    dimension (DTensor weights, of which the local part is used; ``plan`` then counts local experts)."""
    kernel, n = experts.kernel, rows.shape[0]
    gate_up = grouped_mm(rows, experts._in_out(_local(experts.gate_up_proj)), plan.counts, kernel)  # [N, 2 * h]
    if experts.gate_up_proj_bias is not None:
        # Each expert's bias repeated over its rows: its backward sums each expert's rows, where a gather by
        # expert would accumulate one duplicate index per row.
        gate_up = gate_up + _local(experts.gate_up_proj_bias).repeat_interleave(plan.counts, dim=0, output_size=n)
    hidden = expert_activation(gate_up, experts.layout)  # [N, expert_dim]
    out = grouped_mm(hidden, experts._in_out(_local(experts.down_proj)), plan.counts, kernel)  # [N, dim]
    if experts.down_proj_bias is not None:
        out = out + _local(experts.down_proj_bias).repeat_interleave(plan.counts, dim=0, output_size=n)
    return out


def choose_expert_kernels_(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Choose every MoE layer's experts' kernel (``choose_expert_kernel``) for ``device`` and ``dtype``, once, when
    the model is placed on its device (the capability is asked here, not in a forward that may be compiled)."""
    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.kernel = choose_expert_kernel(device.type, dtype, capability, module.inner_dims)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This process's part of an expert weight (a DTensor split over experts), or the weight itself. (Asked of the
    tensor's class, not by an imported type: the models import nothing of torch.distributed; Dynamo answers it of
    the class, not of the instance.)"""
    return weight.to_local() if hasattr(type(weight), "to_local") else weight


def compute_arrived_experts(experts: GroupedExperts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``compute_experts`` over rows that arrived from other processes (expert parallelism's exchange, run or
    simulated): ``rows [N, dim]`` by source process, then by expert within each, ``counts [sources, local experts]``
    the rows each source sent each of this process's experts. Sorted by expert (stably) for the grouped matmul, and
    the outputs put back in arrival order."""
    sources, local = counts.shape
    expert_ids = torch.arange(local, device=rows.device).repeat(sources)
    ids = torch.repeat_interleave(expert_ids, counts.flatten(), output_size=rows.shape[0])  # [N]
    order = torch.argsort(ids, stable=True)
    plan = Dispatch(order=order, experts=ids.index_select(0, order), counts=counts.sum(dim=0))
    out = compute_experts(experts, rows.index_select(0, order), plan)
    return out.index_select(0, inverse_permutation(order))


def loop_experts(experts: GroupedExperts, rows: torch.Tensor, plan: Dispatch) -> torch.Tensor:
    """``compute_experts`` by a Python loop over the experts, one matmul each: the reference the grouped path is
    tested and measured against (``scripts/bench/bench_moe.py``)."""
    outs = []
    for e, expert_rows in enumerate(rows.split(plan.counts.tolist())):
        gate_up = expert_rows @ experts._in_out(experts.gate_up_proj)[e]
        if experts.gate_up_proj_bias is not None:
            gate_up = gate_up + experts.gate_up_proj_bias[e]
        out = expert_activation(gate_up, experts.layout) @ experts._in_out(experts.down_proj)[e]
        if experts.down_proj_bias is not None:
            out = out + experts.down_proj_bias[e]
        outs.append(out)
    return torch.cat(outs)


# -------------------------------------------------------------------------------------------------- the layer


@dataclass(frozen=True)
class RouterOutput:
    """What one MoE layer's router did in the latest forward: its logits ``[T, E]`` (with their graph, for the
    load-balancing loss) and the rows each expert received ``[E]``."""

    logits: torch.Tensor
    counts: torch.Tensor


class MoE(nn.Module):
    """A mixture-of-experts MLP: ``[b, s, dim]`` -> ``([b, s, dim], router logits [T, E], counts [E])``.

    What the router did is returned, not kept by the layer in its forward: a checkpointed block traced by
    ``torch.compile`` may have no side effect, so its block hands it on (``TransformerBlock``) and the decoder keeps
    it on the layer as ``router_output`` (``record_router_output``), which the load-balancing loss and the expert
    metrics read (``moe_router_outputs``).
    """

    def __init__(self, dim: int, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.num_experts, bias=args.router.bias)
        self.experts = GroupedExperts(dim, args)
        self.router_output: Optional[RouterOutput] = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])  # [T, dim]
        logits = self.router(tokens)  # [T, E]
        weights, experts = route(logits, self.args.router, self.args.top_k)  # [T, k] each
        rows, plan = dispatch(tokens, experts, self.args.num_experts)  # [T * k, dim]
        out = combine(self.experts(rows, plan), plan, weights)  # [T, dim]
        return out.view_as(x), logits, plan.counts.detach()

    def record_router_output(self, logits: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep what the router did in the latest forward (outside any compiled or checkpointed region)."""
        self.router_output = RouterOutput(logits=logits, counts=counts)


def moe_args_of(model: nn.Module) -> Optional[MoEArgs]:
    """The ``MoEArgs`` of ``model``'s mixture-of-experts layers (None: a dense model)."""
    return next((m.args for m in model.modules() if isinstance(m, MoE)), None)


def moe_router_outputs(model: nn.Module) -> list[RouterOutput]:
    """The ``RouterOutput`` of every MoE layer of ``model`` from its latest forward, in layer order."""
    return [m.router_output for m in model.modules() if isinstance(m, MoE) and m.router_output is not None]


def load_balancing_loss(logits: list[torch.Tensor], num_experts: int, top_k: int,
                        mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The load-balancing loss over every MoE layer's router logits, as transformers computes it
    (``load_balancing_loss_func``, the Switch Transformer's): ``E * sum_e f_e * P_e``, where ``f_e`` is the share of
    top-k assignments to expert e and ``P_e`` its mean router probability, both over every layer's tokens at once.

    Args:
        logits: each layer's ``[T, E]`` router logits.
        num_experts: E.
        top_k: k.
        mask: ``[T]``, 1 for the tokens counted (transformers' attention mask); None counts every token.

    Returns:
        A float32 0-d tensor.
    """
    device = logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    flat_mask = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_logits in logits:
        probs = F.softmax(layer_logits.float(), dim=-1)
        _, selected = torch.topk(probs, top_k, dim=-1)
        weight = torch.ones_like(probs[:, 0]) if flat_mask is None else flat_mask
        counts = counts.scatter_add(0, selected.reshape(-1), weight.repeat_interleave(top_k))
        prob_sums = prob_sums + (probs * weight.unsqueeze(-1)).sum(dim=0)
        rows = rows + weight.sum()
    return (counts / rows * (prob_sums / rows)).sum() * num_experts
