"""Activation offloading: what a checkpointed block keeps for backward (its input) waits in pinned host memory
instead of on the GPU, and comes back just before the block's backward needs it.

A checkpointed block keeps only its input: non-reentrant ``torch.utils.checkpoint`` saves the inputs through
autograd's saved-tensor mechanism (before its own hooks take over the block's inside), so saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``) pushed around the checkpointed call see exactly them. ``apply``
wraps each checkpointed block's ``forward`` in such hooks (``OffloadedForward``), without changing the module
(state_dict keys, FSDP2's hooks and compile see the same block).

``ActivationOffloader`` decides what to move: tensors that are activations (they require a gradient and are not
parameters: the RoPE tables and, under compile, the weights a compiled block saves stay where they are). On CUDA:

- in forward, each is copied to pinned host memory on a side stream, after the stream that computed it; its GPU
  memory is released to the caching allocator once the copy is done (``record_stream``), not before;
- in backward, when a block's recompute unpacks its input, the copy of the block before it (the next one
  backward reaches) starts back to the GPU on the side stream, so it is there when its turn comes; the compute
  stream waits for that copy's event before using it.

Gradients are those of the run without offloading: the same values come back. On a CPU there is nothing to
offload to (the switch refuses it), but the hooks work all the same with a plain copy instead of the streams,
which is how the tests check the gradients on a CPU.

As a memory feature (``FEATURE``):

    enable_activation_offloading: false | true     # torchtune's key

A CUDA feature: refused with ``device: cpu``, and on a machine without CUDA (``check_device``); and refused with no
activation checkpointing at all (``ac_mode: none``), which leaves nothing it moves. The planner moves the inputs of
the checkpointed blocks from the device's activations to the host, keeping two on the device (the one a block's
backward is using and the one being prefetched).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.memory.feature import Alternative, Feature, FeatureCost, ModelSizes, ResolveInputs
from torchtune_ac.models.families import transformer_blocks
from torchtune_ac.activation_checkpointing.mechanism import is_checkpointed

WHAT = "moves what checkpointed blocks keep for backward from a CUDA device to pinned host memory"
IN_FLIGHT = 2  # block inputs on the device at once in backward: the one in use and the one prefetched


class _HostCopy:
    """One offloaded activation: its copy in host memory, and (once fetched) the copy back on its device.

    Args:
        tensor: the activation.
        stream: the side stream of the copies (CUDA), or None for a plain copy (CPU).
        previous: the activation packed before this one in forward: the next one backward needs.
    """

    def __init__(self, tensor: torch.Tensor, stream: Optional[torch.cuda.Stream], previous: Optional["_HostCopy"]) -> None:
        self.device = tensor.device
        self.stream = stream
        self.previous = previous
        self.on_device: Optional[torch.Tensor] = None
        self.ready: Optional[torch.cuda.Event] = None
        if stream is None:
            self.host = tensor.detach().clone()
            return
        # The side stream copies what the compute stream has computed so far.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            self.host.copy_(tensor.detach(), non_blocking=True)
        # The caching allocator must not hand this memory out again before the copy has read it.
        tensor.record_stream(stream)

    @property
    def nbytes(self) -> int:
        return self.host.untyped_storage().nbytes()

    def prefetch(self) -> None:
        """Start the copy back to the device (on the side stream), if not started yet."""
        if self.on_device is not None:
            return
        if self.stream is None:
            self.on_device = self.host
            return
        with torch.cuda.stream(self.stream):
            self.on_device = self.host.to(self.device, non_blocking=True)
            self.ready = self.stream.record_event()

    def fetch(self) -> torch.Tensor:
        """The activation back on its device, ready for the compute stream."""
        self.prefetch()
        if self.ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(self.ready)
            # Allocated on the side stream, used on the compute stream: freed only after that use.
            self.on_device.record_stream(compute)
            self.ready = None
        return self.on_device


class ActivationOffloader:
    """The saved-tensor hooks of offloading (see the module docstring). One per model: it links each activation
    to the one packed before it, which is the next one backward needs, to prefetch it.

    Attributes:
        offloaded_bytes: bytes moved to host memory so far (for tests and logs).
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: Optional[weakref.ref[_HostCopy]] = None
        self.offloaded_bytes = 0

    def _stream(self, device: torch.device) -> Optional[torch.cuda.Stream]:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, tensor: torch.Tensor) -> Any:
        if not tensor.requires_grad or isinstance(tensor, nn.Parameter):
            return tensor  # not an activation: a constant table, or a weight that stays resident anyway
        # A copy packed in an earlier micro-batch's forward is gone once its backward has run: no link then.
        previous = self._last() if self._last is not None else None
        copy = _HostCopy(tensor, self._stream(tensor.device), previous)
        self._last = weakref.ref(copy)
        self.offloaded_bytes += copy.nbytes
        return copy

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        tensor = packed.fetch()
        if packed.previous is not None:
            packed.previous.prefetch()
        return tensor


class OffloadedForward:
    """Stands in for a checkpointed block's ``forward``: runs it under the offloader's saved-tensor hooks.

    Set as an instance attribute over the checkpointed forward, as ``CheckpointedForward`` is, so the block's
    class, parameters, hooks and state_dict keys are untouched.
    """

    def __init__(self, forward: Callable[..., Any], offloader: ActivationOffloader) -> None:
        self.inner_forward = forward
        self.offloader = offloader

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self.offloader.pack, self.offloader.unpack):
            return self.inner_forward(*args, **kwargs)


def apply_activation_offloading(model: nn.Module) -> ActivationOffloader:
    """Offload what each checkpointed block of ``model`` keeps (apply AC first: a block that is not checkpointed
    is left alone); returns the offloader."""
    offloader = ActivationOffloader()
    for block in transformer_blocks(model):
        if is_checkpointed(block):
            block.forward = OffloadedForward(block.forward, offloader)
    return offloader


# ----------------------------------------------------------------------------------------------------- the feature


def _resolve(inputs: ResolveInputs) -> bool:
    if not inputs.memory.enable_activation_offloading:
        return False
    if inputs.device == "cpu":
        raise UserError(f"enable_activation_offloading=true with device=cpu: it {WHAT}; on a CPU they are in host "
                        "memory already: set enable_activation_offloading: false")
    ac = inputs.settings.get("ac")
    if ac is not None and not ac.checkpointed_blocks:
        raise UserError(f"enable_activation_offloading=true with no activation checkpointing: it {WHAT}, and no "
                        "block is checkpointed; set enable_activation_checkpointing: true (or an ac_mode)")
    return True


def _check_device(setting: bool, device: torch.device) -> None:
    if setting and device.type != "cuda":
        raise UnavailableError(f"enable_activation_offloading=true: it {WHAT}, and this run is on {device.type} "
                               "(no CUDA here): set enable_activation_offloading: false")


def _describe(setting: bool, vocab_size: Optional[int]) -> str:
    if not setting:
        return "off"
    return ("the inputs checkpointed blocks keep, in pinned host memory: copied on a side stream in forward, "
            "prefetched a block ahead in backward")


def _planner_cost(setting: bool, sizes: ModelSizes) -> FeatureCost:
    if not setting or not sizes.checkpointed_blocks:
        return FeatureCost()
    kept = sizes.checkpointed_blocks * sizes.block_input
    moved = max(0, min(sizes.so_far["activations"], kept) - min(IN_FLIGHT, sizes.checkpointed_blocks) * sizes.block_input)
    return FeatureCost(device={"activations": -moved}, host={"activations": kept})


def _alternatives(setting: bool) -> list[Alternative]:
    return [] if setting else [Alternative("enable_activation_offloading=true", True)]


FEATURE = Feature(name="enable_activation_offloading", label="activation offloading", off=False, resolve=_resolve,
                  describe=_describe, check_device=_check_device, planner_cost=_planner_cost,
                  alternatives=_alternatives)
