"""The adapters' mechanism: which linears are targets (``find_targets``), wrapping them in place (``apply_adapters``,
the written order's slot), their PEFT initialisation once the base is loaded (``initialize_adapters_``), QLoRA's
NF4 base (``quantize_base_``), switching them off (``adapters_off``: DPO's reference) and the merged weights.

A wrapped linear keeps its class's behaviour and its own ``weight`` and ``bias`` under the same names (the base's
state_dict keys, the checkpoint loader, FSDP2's groups and the per-op AC policy see the same linear), and gains
``lora_a`` ``[r, in]``, ``lora_b`` ``[out, r]`` and, for DoRA, ``lora_magnitude`` ``[out]``, as PEFT's
``lora_A``, ``lora_B`` and ``lora_magnitude_vector``. The forward is PEFT 0.21's (``peft/tuners/lora/layer.py``'s
``Linear.forward``, ``dora.py``'s ``DoraLinearLayer.forward``), written from its arithmetic.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from torchtune_ac.errors import UserError
from torchtune_ac.lora.config import AdapterConfig, AdapterKind, QuantizeBase
from torchtune_ac.models.families import family_of

# NF4 as torchao quantises it (torchtune's QLoRA used the same): blocks of 64 weights, their scales quantised in
# blocks of 256.
NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256
OUTPUT = "output"  # the output projection's module name (PEFT's lm_head)


class AdaptedLinear(nn.Linear):
    """A linear with a low-rank adapter (see the module docstring): made by ``apply_adapters`` from an ``nn.Linear``
    (or the output projection), never built directly."""

    lora_a: nn.Linear
    lora_b: nn.Linear
    lora_magnitude: Optional[nn.Parameter]
    lora_scale: float
    lora_dropout: nn.Module
    adapters_enabled: bool

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def adapted(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``base`` (the base linear's output on ``x``) plus the adapter's update: LoRA's ``s B A drop(x)``, or
        DoRA's rescaling of the rows of ``W + s B A`` to ``lora_magnitude`` (PEFT's arithmetic, the norm detached)."""
        if not self.adapters_enabled:
            return base
        if self.lora_magnitude is None:
            return base + self.lora_b(self.lora_a(self.lora_dropout(x))) * self.lora_scale
        dropped = self.lora_dropout(x)
        if dropped is not x:  # PEFT recomputes the base's part on the dropped input (without the bias)
            base_part = F.linear(dropped, self.dense_weight().to(x.dtype))
        else:
            base_part = base - self.bias if self.bias is not None else base
        delta = self.lora_b.weight @ self.lora_a.weight  # [out, r] @ [r, in]
        norm = torch.linalg.norm(self.dense_weight().to(x.dtype) + self.lora_scale * delta.detach().to(x.dtype),
                                 dim=1).detach()  # [out]
        factor = (self.lora_magnitude / norm).view(1, -1)
        return base + (factor - 1) * base_part + factor * self.lora_b(self.lora_a(dropped)) * self.lora_scale

    def dense_weight(self) -> torch.Tensor:
        """The base weight in dense form (an NF4 weight dequantised)."""
        return dense(self.weight)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # noqa: D401 - nn.Module's
        if self.adapters_enabled and self.lora_magnitude is None and _fusable(self, x):
            return LoRALinear.apply(x, self.weight, self.bias, self.lora_a.weight, self.lora_b.weight,
                                    self.lora_scale)
        return self.adapted(x, self.base_forward(x))

    def forward_shared(self, x: torch.Tensor, linears: tuple[nn.Module, ...]) -> Optional[tuple[torch.Tensor, ...]]:
        """Each of ``linears`` (this one first) on their shared input ``x``, in one ``LoRAGroup``: the models'
        ``project`` asks. None where one of them is not fused alone (``_fusable``), runs hooks a direct call would
        skip (FSDP2's or tensor parallelism's on the linear itself), or when compiling (the graph stays the
        per-linear one): the caller then calls each."""
        if torch.compiler.is_compiling() or _global_hooks():
            return None
        tensors: list[Optional[torch.Tensor]] = []
        for linear in linears:
            if not (isinstance(linear, AdaptedLinear) and linear.adapters_enabled and linear.lora_magnitude is None
                    and _fusable(linear, x) and not _has_hooks(linear)):
                return None
            tensors += (linear.weight, linear.bias, linear.lora_a.weight, linear.lora_b.weight)
        return LoRAGroup.apply(x, tuple(linear.lora_scale for linear in linears), *tensors)


def _fusable(linear: AdaptedLinear, x: torch.Tensor) -> bool:
    """Whether ``LoRALinear`` computes ``linear``'s LoRA forward: a dense frozen base (not NF4) of ``x``'s dtype and
    no dropout in training (its mask would sit between ``x`` and ``A``)."""
    weight = linear.weight
    return (type(weight) in (nn.Parameter, torch.Tensor) and not weight.requires_grad
            and (linear.bias is None or not linear.bias.requires_grad)
            and x.dtype == weight.dtype == linear.lora_a.weight.dtype == linear.lora_b.weight.dtype
            and (isinstance(linear.lora_dropout, nn.Identity) or not linear.training))


class LoRALinear(torch.autograd.Function):
    """``x W^T + b + s (x A^T) B^T`` for a frozen ``W``, with the memory traffic of LoRA's arithmetic cut to what it
    needs (PEFT's and the unfused path's numbers, summed in another order).

    Written by hand because no library fuses it for a CPU or a plain GPU: the unfused path makes three more passes over
    the ``[tokens, out]`` output in forward (``B (A x)``, its scaling, the sum) and one over ``[tokens, in]`` in
    backward (the two input gradients' sum). Here the update is added by ``addmm`` (in place in eager, the scale its
    ``alpha``), the input gradients are summed in place by ``addmm_``, and ``W``'s gradient is never formed. Every
    rank-wide product is written with the rank first: ``A x^T``, ``B^T g^T``, ``(A x^T) g``. CPU kernels run
    ``x A^T`` (a ``[tokens, r]`` result) and ``g^T (A x)`` (a transposed ``[out, tokens]`` operand) several times
    slower than those, for the same numbers. Saved: ``x`` and ``A x^T``, as the unfused path saves ``x`` and ``A x``;
    per-op AC's policy sees the same matrix multiplies (``mm`` for the base and for ``A x^T``, kept; ``addmm`` for
    the widening update, recomputed)."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale):  # noqa: D102 - the class docstring
        rows = x.reshape(-1, x.shape[-1])
        base = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
        low_t = torch.mm(lora_a, rows.t())  # [r, tokens]: A x^T, not x A^T (a rank-wide product, see the docstring)
        out = _add_update(base, low_t.t(), lora_b, scale)
        ctx.save_for_backward(x, weight, lora_a, lora_b, low_t)
        ctx.scale = scale
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        x, weight, lora_a, lora_b, low_t = ctx.saved_tensors
        rows, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        grad_low_t = torch.mm(lora_b.t(), grad.t()).mul_(ctx.scale)  # [r, tokens]
        grad_a = torch.mm(grad_low_t, rows) if ctx.needs_input_grad[3] else None
        grad_b = torch.mm(low_t, grad).mul_(ctx.scale).t().contiguous() if ctx.needs_input_grad[4] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad, weight).addmm_(grad_low_t.t(), lora_a).view(x.shape)
        return grad_x, None, None, grad_a, grad_b, None


def _add_update(base: torch.Tensor, low: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """``base + scale * low B^T``: in place in ``base`` (a fresh product nothing else holds) in eager, where an
    out-of-place ``addmm`` would first copy the ``[tokens, out]`` base; out of place under a dispatch mode (per-op
    AC's keeps ``base``, a matmul's output, and refuses it mutated) and when compiling (the graph as before)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return torch.addmm(base, low, lora_b.t(), alpha=scale)
    return base.addmm_(low, lora_b.t(), alpha=scale)


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module._compiled_call_impl is not None)


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks or module._global_backward_hooks
                or module._global_backward_pre_hooks)


class LoRAGroup(torch.autograd.Function):
    """``LoRALinear`` for several linears of one input (attention's q, k and v; the MLP's gate and up): their A's
    stacked read ``x`` once in forward (``[A_1; A_2; ...] x^T``) and once for all their gradients in backward, and
    the input's gradient is summed in place, the bases' ``g_i W_i`` and every adapter's in one ``addmm_``. The
    parameters are each linear's own, stacked in forward (``torch.cat`` of ``[r, in]`` matrices): their names,
    state_dict, sharding and optimizer state are the single linears'.

    Called as ``apply(x, scales, *tensors)``: ``tensors`` are each linear's ``weight, bias, lora_a, lora_b``.
    Returns each linear's output."""

    @staticmethod
    def forward(ctx, x, scales, *tensors):  # noqa: D102 - the class docstring
        weights, biases, lora_as, lora_bs = tensors[0::4], tensors[1::4], tensors[2::4], tensors[3::4]
        rows = x.reshape(-1, x.shape[-1])
        stacked_a = torch.cat(lora_as)  # [sum r, in]
        low_t = torch.mm(stacked_a, rows.t())  # [sum r, tokens]
        ranks = [a.shape[0] for a in lora_as]
        outs = []
        for weight, bias, lora_b, scale, low in zip(weights, biases, lora_bs, scales, low_t.split(ranks)):
            base = torch.mm(rows, weight.t()) if bias is None else torch.addmm(bias, rows, weight.t())
            out = _add_update(base, low.t(), lora_b, scale)
            outs.append(out.view(*x.shape[:-1], out.shape[-1]))
        ctx.save_for_backward(x, stacked_a, low_t, *weights, *lora_bs)
        ctx.scales, ctx.ranks = scales, ranks
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        x, stacked_a, low_t, *rest = ctx.saved_tensors
        count = len(ctx.scales)
        weights, lora_bs = rest[:count], rest[count:]
        rows = x.reshape(-1, x.shape[-1])
        grads = [grad.reshape(-1, grad.shape[-1]) for grad in grads]
        grad_low_t = torch.cat([torch.mm(lora_b.t(), grad.t()).mul_(scale)  # [r, tokens] each
                                for lora_b, grad, scale in zip(lora_bs, grads, ctx.scales)])
        needs = ctx.needs_input_grad[2:]
        grad_as = [None] * count
        if any(needs[2::4]):
            grad_as = list(torch.mm(grad_low_t, rows).split(ctx.ranks))  # [sum r, in], split by linear
        grad_bs = [torch.mm(low, grad).mul_(scale).t().contiguous() if need else None
                   for low, grad, scale, need in zip(low_t.split(ctx.ranks), grads, ctx.scales, needs[3::4])]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grads[0], weights[0])
            for grad, weight in zip(grads[1:], weights[1:]):
                grad_x.addmm_(grad, weight)
            grad_x = grad_x.addmm_(grad_low_t.t(), stacked_a).view(x.shape)
        tensor_grads = []
        for grad_a, grad_b, need_a in zip(grad_as, grad_bs, needs[2::4]):
            tensor_grads += (None, None, grad_a if need_a else None, grad_b)
        return (grad_x, None, *tensor_grads)


class AdaptedOutput(AdaptedLinear):
    """The output projection with an adapter: the update is added to the logits before the softcap, as PEFT's
    ``lm_head`` adapter is (transformers applies the cap after the layer)."""

    softcap: Optional[float]
    takes_head = False  # the loss is then the whole logits' (``ChunkedCrossEntropyObjective`` in one chunk)

    def forward(self, x: torch.Tensor, head=None) -> torch.Tensor:
        if head is not None:
            raise RuntimeError("an adapter on the output projection does not run under the chunked loss")
        logits = self.adapted(x, self.base_forward(x))
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def find_targets(model: nn.Module, config: AdapterConfig) -> dict[str, nn.Linear]:
    """The linears ``config`` names, by their module names in ``model``: each whose last name part is in
    ``targets`` (PEFT's suffix match; a mixture of experts' experts are not linears), and the output projection
    with ``output``. On a vision-language model only the language model's: its family's ``vision_modules`` (the
    tower and projector) are not searched.

    Raises:
        UserError: a target that matches nothing, naming the linears' names that exist (or that it names only
            linears of the vision tower).
    """
    family = family_of(model)
    vision = family.vision_modules if family is not None else ()
    found: dict[str, nn.Linear] = {}
    available: set[str] = set()
    in_tower: set[str] = set()
    matched: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != OUTPUT:
            leaf = name.rsplit(".", 1)[-1]
            if name.split(".", 1)[0] in vision:
                in_tower.add(leaf)
                continue
            available.add(leaf)
            if leaf in config.targets:
                found[name] = module
                matched.add(leaf)
    missing = [t for t in config.targets if t not in matched]
    tower_only = [t for t in missing if t in in_tower]
    if tower_only:
        raise UserError(f"adapter.targets: {', '.join(tower_only)} name(s) only linears of the vision tower "
                        f"({', '.join(vision)}), which adapters do not reach; the language model's linears are "
                        f"{', '.join(sorted(available))} (the tower trains whole in full_finetune; docs/vision.md)")
    if missing:
        raise UserError(f"adapter.targets: {', '.join(missing)} match(es) no linear of this model; its linears are "
                        f"{', '.join(sorted(available))} (and output: adapter.output)")
    if config.output:
        output = getattr(model, OUTPUT, None)
        if not isinstance(output, nn.Linear):
            raise UserError("adapter.output=true: this model has no output projection of its own")
        found[OUTPUT] = output
    return found


def check_adapters(model: nn.Module, config: AdapterConfig, *, loss_chunks: int = 1) -> dict[str, nn.Linear]:
    """Everything about ``config`` that the meta model can answer, before any weight is loaded (see
    ``find_targets``): the output's adapter against tied embeddings and the chunked loss, NF4's block sizes.

    Raises:
        UserError: one line, naming the key.
    """
    targets = find_targets(model, config)
    if config.output:
        embeddings = getattr(model, "tok_embeddings", None)
        if embeddings is not None and embeddings.weight is model.output.weight:
            raise UserError("adapter.output=true: this model ties its output projection to its embeddings; PEFT "
                            "adapts lm_head alone, which would untie them: set adapter.output: false")
        if loss_chunks > 1:
            raise UserError(f"adapter.output=true: the chunked loss (loss_chunks={loss_chunks}) computes the logits "
                            "from the output weight itself; set loss_chunks: 1 or adapter.output: false")
    if config.quantize_base is QuantizeBase.NF4:
        for name, linear in targets.items():
            if name == OUTPUT:
                raise UserError("adapter.quantize_base=nf4 with adapter.output=true: the output projection stays in "
                                "dtype (as torchtune's QLoRA); set adapter.output: false")
            numel = linear.weight.numel()
            if numel % (NF4_BLOCK * NF4_SCALER_BLOCK):
                raise UserError(f"adapter.quantize_base=nf4: {name}.weight {tuple(linear.weight.shape)} has {numel} "
                                f"weights, not a multiple of {NF4_BLOCK} x {NF4_SCALER_BLOCK} (torchao's NF4 blocks); "
                                "drop its name from adapter.targets or set adapter.quantize_base: null")
    return targets


def apply_adapters(model: nn.Module, config: AdapterConfig, *, loss_chunks: int = 1) -> dict[str, AdaptedLinear]:
    """Wrap the chosen linears of ``model`` (on any device: the meta one in a run) in place, and freeze every other
    parameter: the adapters are the only trainable ones. Their values are drawn later (``initialize_adapters_``).

    Returns:
        The adapted linears by module name.
    """
    targets = check_adapters(model, config, loss_chunks=loss_chunks)
    model.requires_grad_(False)
    adapted: dict[str, AdaptedLinear] = {}
    for name, linear in targets.items():
        weight = linear.weight
        out_features, in_features = weight.shape
        factory = {"device": weight.device, "dtype": weight.dtype}
        linear.__class__ = AdaptedOutput if name == OUTPUT else AdaptedLinear
        linear.lora_a = nn.Linear(in_features, config.rank, bias=False, **factory)
        linear.lora_b = nn.Linear(config.rank, out_features, bias=False, **factory)
        linear.lora_magnitude = (nn.Parameter(torch.empty(out_features, **factory))
                                 if config.kind is AdapterKind.DORA else None)
        linear.lora_dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        linear.lora_scale = config.scale
        linear.adapters_enabled = True
        adapted[name] = linear
    return adapted


def adapted_linears(model: nn.Module) -> Iterator[tuple[str, AdaptedLinear]]:
    """``model``'s adapted linears, by module name (in a sharded or compiled model too)."""
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLinear):
            yield clean_name(name), module


def clean_name(name: str) -> str:
    """A module name without the wrappers' parts (``torch.compile``'s ``_orig_mod``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


@torch.no_grad()
def initialize_adapters_(model: nn.Module, *, seed: int) -> None:
    """PEFT's initialisation, once the base weights are in place: A Kaiming-uniform (``a = sqrt(5)``, as
    ``nn.Linear`` and PEFT), B zero, DoRA's magnitude the norms of the base's rows, so the model computes the base
    exactly. A is drawn whole, in module order, from a generator seeded by ``seed``: the same values on any number
    of processes (each keeps its shard)."""
    generator = torch.Generator().manual_seed(seed)
    for _, linear in adapted_linears(model):
        a = linear.lora_a.weight
        full = torch.empty(a.shape, dtype=torch.float32)
        # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / 6), bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in)
        bound = 1 / math.sqrt(a.shape[1])
        full.uniform_(-bound, bound, generator=generator)
        copy_whole_(a, full)
        linear.lora_b.weight.zero_()
        if linear.lora_magnitude is not None and hasattr(linear.weight, "device_mesh") and hasattr(
                linear.weight.to_local(), "get_original_weight"):
            # An NF4 base sharded by rows (``sharded_nf4``): each rank's rows of the magnitude, those of its shard.
            rows = dense(linear.weight.to_local())
            linear.lora_magnitude.to_local().copy_(torch.linalg.norm(rows.float(), dim=1))
        elif linear.lora_magnitude is not None:
            weight = dense(whole(linear.weight))
            copy_whole_(linear.lora_magnitude, torch.linalg.norm(weight.float(), dim=1))


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a plain tensor: an NF4 weight (or this rank's NF4 rows) dequantised, any other as it is."""
    return tensor.get_original_weight() if hasattr(tensor, "get_original_weight") else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a sharded DTensor gathered."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@torch.no_grad()
def copy_whole_(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param`` (a plain tensor, or a DTensor this rank holds a shard of) to the whole ``value``."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        value = distribute_tensor(value.to(param.dtype), param.device_mesh, param.placements)
        param.to_local().copy_(value.to_local())
    else:
        param.copy_(value.to(param.dtype))


@torch.no_grad()
def quantize_base_(model: nn.Module) -> int:
    """QLoRA: every adapted linear's base weight stored as torchao's ``NF4Tensor`` (frozen, dequantised for each
    matmul). Runs after the weights are loaded; a weight already in NF4 (sharded by FSDP2: ``sharded_nf4``) is left
    as it is.

    Returns:
        How many weights were quantised.
    """
    from torchao.quantization import to_nf4

    count = 0
    for _, linear in adapted_linears(model):
        weight = linear.weight
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if hasattr(local, "get_original_weight"):
            continue
        linear.weight = nn.Parameter(to_nf4(weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK), requires_grad=False)
        count += weight.numel()
    return count


@contextlib.contextmanager
def base_only(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` without its adapters' modules and parameters inside the block: what a Hugging Face checkpoint of
    the base holds (loading the base, writing the merged model)."""
    hidden = []
    for _, linear in adapted_linears(model):
        hidden.append((linear, linear._modules.pop("lora_a"), linear._modules.pop("lora_b"),
                       linear._parameters.pop("lora_magnitude", None)))
    try:
        yield model
    finally:
        for linear, lora_a, lora_b, magnitude in hidden:
            linear._modules["lora_a"], linear._modules["lora_b"] = lora_a, lora_b
            if magnitude is not None:
                linear._parameters["lora_magnitude"] = magnitude


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` computing its base alone inside the block (DPO's reference: TRL's ``disable_adapter()``)."""
    linears = [linear for _, linear in adapted_linears(model)]
    for linear in linears:
        linear.adapters_enabled = False
    try:
        yield model
    finally:
        for linear in linears:
            linear.adapters_enabled = True


@torch.no_grad()
def merge_rows(weight: torch.Tensor, lora_b: torch.Tensor, lora_a: torch.Tensor, magnitude: Optional[torch.Tensor],
               scale: float) -> torch.Tensor:
    """Rows of the base weight with the adapter merged in (PEFT's ``merge``): ``W + s B A`` for LoRA, each row of
    it rescaled to its magnitude for DoRA; computed in float32, returned in ``weight``'s dtype.

    Args:
        weight: ``[rows, in]`` (all the base's rows, or this rank's shard of them).
        lora_b: ``[rows, r]``, the same rows of B.
        lora_a: ``[r, in]``, A whole.
        magnitude: ``[rows]``, the same rows of DoRA's magnitude; None for LoRA.
    """
    merged = weight.float() + scale * (lora_b.float() @ lora_a.float())
    if magnitude is not None:
        merged = merged * (magnitude.float() / torch.linalg.norm(merged, dim=1)).view(-1, 1)
    return merged.to(weight.dtype)


def merged_weight(linear: AdaptedLinear) -> torch.Tensor:
    """``linear``'s merged weight (``merge_rows``) as its base weight is held: a plain tensor, or a DTensor of this
    rank's rows when FSDP2 shards it (B and DoRA's magnitude are split along the same rows; A is gathered)."""
    weight, magnitude = linear.weight, linear.lora_magnitude
    if not hasattr(weight, "device_mesh"):
        return merge_rows(linear.dense_weight(), linear.lora_b.weight, linear.lora_a.weight, magnitude,
                          linear.lora_scale)
    from torch.distributed.tensor import DTensor

    for other in (linear.lora_b.weight, magnitude):
        if other is not None and other.placements != weight.placements:
            raise ValueError(f"the adapter's rows are split as {other.placements}, the base's as {weight.placements}")
    # An NF4 base's rows are dequantised here: NF4Tensor has no arithmetic (``.float()`` of a float32 one is itself).
    rows = merge_rows(dense(weight.to_local()), linear.lora_b.weight.to_local(), whole(linear.lora_a.weight),
                      None if magnitude is None else magnitude.to_local(), linear.lora_scale)
    return DTensor.from_local(rows, weight.device_mesh, weight.placements, shape=weight.shape, stride=weight.stride())
