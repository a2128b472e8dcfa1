"""Measuring what a forward keeps for backward (with and without activation checkpointing), and peak RSS."""

import functools
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import _measure as memory
import pytest
import torch
from _measure import measure_saved_activation_bytes, track_peak_rss
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtune_ac.models.llama import Llama, LlamaArgs
from torchtune_ac.activation_checkpointing.config import setup_activation_checkpointing

F32 = 4


def build_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(), nn.Linear(256, 64, bias=False))


def save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE


# x: [32, 64] -> mm -> h: [32, 256] -> gelu -> g: [32, 256] -> mm -> y: [32, 64]
X, H, G, Y = 32 * 64 * F32, 32 * 256 * F32, 32 * 256 * F32, 32 * 64 * F32
WEIGHTS = 2 * 64 * 256 * F32


@pytest.mark.parametrize(
    "ac, exclude_params, want",
    [
        (None, True, X + H + G),  # mm saves x, gelu saves h, the second mm saves g
        (None, False, X + H + G + WEIGHTS),  # the mms also save (views of) the weights
        ("full", True, X),  # only the checkpoint input
        ("op", True, X + H + Y),  # the input plus both mm outputs kept by the policy (gelu is recomputed)
    ],
)
def test_measured_bytes_match_hand_count(ac, exclude_params, want):
    model = build_mlp()
    if ac == "full":
        checkpoint(model)
    elif ac == "op":
        checkpoint(model, context_fn=functools.partial(create_selective_checkpoint_contexts, save_matmuls))
    x = torch.randn(32, 64, requires_grad=True)
    exclude = list(model.parameters()) if exclude_params else []
    assert measure_saved_activation_bytes(model, x, exclude=exclude) == want


def test_shared_storages_count_once():
    x = torch.randn(1000, requires_grad=True)
    # mul saves both operands: the same tensor twice.
    assert measure_saved_activation_bytes(lambda t: (t * t).sum(), x) == 1000 * F32
    # exp saves its result; two slices of it are saved again by mul: still one storage.
    assert measure_saved_activation_bytes(lambda t: (lambda e: e[:500] * e[500:])(t.exp()), x) == 1000 * F32
    # Output dropped and not saved by anything: nothing counted besides the input sin saves.
    assert measure_saved_activation_bytes(lambda t: t.sin() + 1, x) == 1000 * F32


def build_tiny_llama(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    args = LlamaArgs(vocab_size=128, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, intermediate_dim=96, max_seq_len=256)
    return Llama(args)


def measure_setting(mode, option, tokens) -> int:
    model = build_tiny_llama()
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
    return measure_saved_activation_bytes(model, tokens, exclude=list(model.parameters()))


def test_activation_bytes_order_across_ac_settings():
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2, 128))
    measured = {
        name: measure_setting(mode, option, tokens)
        for name, mode, option in [
            ("none", None, None), ("k4", "selective", 4), ("k2", "selective", 2),
            ("k1", "selective", 1), ("full", "full", None), ("op", "selective", "op"),
        ]
    }
    assert measured["none"] > measured["k4"] > measured["k2"] > measured["full"]
    assert measured["full"] < measured["op"] < measured["none"]
    assert measured["k1"] == measured["full"]
    # Every block saves the same amount, so each checkpointed block frees the same bytes.
    freed_per_block = (measured["none"] - measured["full"]) / 8
    assert measured["none"] - measured["k4"] == pytest.approx(2 * freed_per_block, rel=1e-6)
    assert measured["none"] - measured["k2"] == pytest.approx(4 * freed_per_block, rel=1e-6)
    # What full AC keeps per block is its input hidden state [b, s, dim].
    block_input = 2 * 128 * 32 * F32
    assert measured["full"] >= 8 * block_input
    assert measured["full"] < 8 * block_input + 0.2 * measured["none"]


def live_tensor_ids() -> set:
    return {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}


@pytest.mark.parametrize("mode, option", [(None, None), ("full", None), ("selective", "op")])
def test_measuring_is_repeatable_and_frees_everything_it_measured(mode, option):
    torch.manual_seed(1)
    tokens = torch.randint(0, 128, (2, 64))
    model = build_tiny_llama()
    setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)

    def forward_and_loss(t):
        logits = model(t[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten())

    gc.collect()
    before = live_tensor_ids()
    first = measure_saved_activation_bytes(forward_and_loss, tokens, exclude=list(model.parameters()))
    gc.collect()
    # Saving an output through a hook must not create a reference cycle that keeps the graph alive.
    assert live_tensor_ids() - before == set()
    second = measure_saved_activation_bytes(forward_and_loss, tokens, exclude=list(model.parameters()))
    assert first == second > 0
    assert all(p.grad is None for p in model.parameters())


def hold_allocation(nbytes: int, seconds: float) -> None:
    block = torch.ones(nbytes // F32)  # ones, not empty: untouched pages would not be resident
    time.sleep(seconds)
    del block


@pytest.mark.parametrize("use_proc", [True, False], ids=["VmHWM", "psutil"])
def test_peak_rss_sees_a_transient_allocation(monkeypatch, use_proc):
    if not use_proc:
        monkeypatch.setattr(memory, "_reset_vm_hwm", lambda: False)
    elif not memory._reset_vm_hwm():
        pytest.skip("/proc/self/clear_refs is not writable here")
    size = 256 * 2**20
    with track_peak_rss() as before:
        pass
    with track_peak_rss() as peak:
        hold_allocation(size, 0.2)
    assert peak.method == ("VmHWM" if use_proc else "psutil")
    assert peak.peak_bytes >= before.peak_bytes + 0.9 * size


RETENTION_SCRIPT = """
import ctypes, ctypes.util, gc, json, psutil, torch
from _measure import return_freed_memory_to_os
# Serve 4 MiB blocks from the heap (as glibc does on its own once large blocks have been freed).
ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 64 * 2**20)  # M_MMAP_THRESHOLD
process = psutil.Process()
return_freed_memory_to_os()
baseline = process.memory_info().rss
blocks = [torch.ones(2**20) for _ in range(64)]  # 64 x 4 MiB
survivors = blocks[1::2]  # every other block stays, so the heap cannot shrink from its top on its own
del blocks
gc.collect()
retained = process.memory_info().rss
trimmed = return_freed_memory_to_os()
print(json.dumps([trimmed, (retained - baseline) / 2**20, (process.memory_info().rss - baseline) / 2**20]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_heap_goes_back_to_the_os():
    run = subprocess.run([sys.executable, "-c", RETENTION_SCRIPT], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3])
    trimmed, retained_mib, after_trim_mib = json.loads(run.stdout.strip().splitlines()[-1])
    assert trimmed is True
    assert retained_mib > 200  # 128 MiB live plus 128 MiB freed but still resident
    assert after_trim_mib < 128 + 32
