"""Measuring memory: bytes kept for backward by a forward pass, and the process's peak resident memory.

``measure_saved_activation_bytes`` is how the activation checkpointing benchmark and tests compare AC
settings on CPU, where PyTorch has no allocator statistics.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import psutil
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _RecordOutputStorages(TorchDispatchMode):
    """Remembers (weakly) the storage of every tensor any op produces, keyed by its address."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                storage = leaf.untyped_storage()
                if storage.nbytes() > 0:
                    # Storage objects are preserved while their memory is alive, so the weakref dies exactly
                    # when the memory is freed.
                    self.storages[storage.data_ptr()] = weakref.ref(storage)
        return out


def measure_saved_activation_bytes(
    fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = (), compiled: bool = False, **kwargs: Any
) -> int:
    """Bytes kept alive for the backward pass by one call of ``fn(*args, **kwargs)`` (the forward only).

    Definition: the total size of the distinct tensor storages (deduplicated by address, so views and
    tensors saved twice count once) that are either
      (a) packed for backward by autograd (seen through ``torch.autograd.graph.saved_tensors_hooks``), or
      (b) produced by an op during the call and still alive once the call's outputs are released while
          their autograd graph is kept, which is where per-op activation checkpointing caches the outputs
          it saves (outside autograd's saved tensors, so (a) alone would miss them),
    minus the storages of the ``exclude`` tensors (pass the parameters: they are not activations).
    With activation checkpointing the forward saves only each checkpointed block's inputs (plus, per-op,
    the outputs its policy keeps); what backward recomputes transiently is not counted.

    Args:
        fn: the forward to measure, e.g. ``lambda t: loss_fn(model(t), labels)``. It must return tensors
            (or a pytree of them) that carry the autograd graph.
        *args: positional arguments for ``fn``.
        exclude: tensors whose storages are not counted (typically ``model.parameters()``).
        compiled: ``fn`` runs compiled regions: only (a) is counted. Under a dispatch mode (which (b) needs)
            ``torch.compile`` runs its frames eagerly; a compiled region, checkpointed or not, saves everything it
            keeps through ``save_for_backward``, which the hooks see (per-op AC's caches outside a compiled region
            would be missed).
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The number of bytes.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    packed: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        packed[storage.data_ptr()] = storage.nbytes()
        # Detached: an output saved by its own grad_fn would otherwise reference that node from inside it,
        # a cycle through C++ that Python's gc cannot collect (the whole graph would leak).
        return tensor.detach()

    recorder = _RecordOutputStorages()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            contextlib.nullcontext() if compiled else recorder:
        outputs = fn(*args, **kwargs)
    # Keep the graph (it owns everything saved for backward) but drop the outputs themselves: an output
    # counts only if something in the graph saved it.
    graph = [t.grad_fn for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    del outputs
    gc.collect()
    alive = {ptr: ref().nbytes() for ptr, ref in recorder.storages.items() if ref() is not None}
    held = {**alive, **packed}
    total = sum(nbytes for ptr, nbytes in held.items() if ptr not in excluded)
    del graph
    return total


def _read_vm_hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise OSError("VmHWM not found in /proc/self/status")


def _reset_vm_hwm() -> bool:
    """Reset the kernel's resident-memory high-water mark for this process (Linux); False if unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # "5" resets VmHWM to the current RSS (see proc(5))
        _read_vm_hwm_bytes()
    except OSError:
        return False
    return True


def return_freed_memory_to_os() -> bool:
    """Give memory that glibc's malloc holds for reuse back to the OS (Linux), so RSS drops to live data.

    Freed tensors of a few MiB stay in malloc's heap; without this, the next run's peak RSS would start
    from the previous run's leftovers. Allocation behaviour is not changed (only ``malloc_trim`` is called).

    Returns:
        True if glibc's ``malloc_trim`` ran; False elsewhere (nothing changed).
    """
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name is not None else None
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    gc.collect()
    libc.malloc_trim(0)
    return True


class PeakRSS:
    """Result holder for ``track_peak_rss``: ``peak_bytes`` is set when the block exits."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.peak_bytes: Optional[int] = None


@contextlib.contextmanager
def track_peak_rss(sample_interval_s: float = 0.005) -> Iterator[PeakRSS]:
    """Measure the peak resident set size of this process during the ``with`` block.

    On Linux the kernel's high-water mark is reset on entry and read on exit (exact). Elsewhere, or if
    ``/proc/self/clear_refs`` is not writable, a background thread samples RSS with psutil (may miss
    short spikes).

    Args:
        sample_interval_s: sampling period of the psutil fallback.

    Yields:
        A ``PeakRSS`` whose ``peak_bytes`` and ``method`` (``"VmHWM"`` or ``"psutil"``) are set on exit.
    """
    if _reset_vm_hwm():
        result = PeakRSS("VmHWM")
        try:
            yield result
        finally:
            result.peak_bytes = _read_vm_hwm_bytes()
        return

    result = PeakRSS("psutil")
    process = psutil.Process()
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(sample_interval_s):
            peak[0] = max(peak[0], process.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield result
    finally:
        stop.set()
        sampler.join()
        result.peak_bytes = max(peak[0], process.memory_info().rss)
