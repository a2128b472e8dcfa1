"""What the GPU suite and the GPU check call that needs no GPU, called here on a CPU.

A GPU is lent for minutes (``scripts/gpu_check.sh``), and on a CPU every ``cuda`` test is skipped, so a renamed
function, a changed signature or a config key that no longer validates would first show there. These tests make
the same calls on the CPU: ``test_tune_run_cuda``'s overrides through ``tune validate`` and its planner helper,
``test_offload``'s CUDA overrides, ``gpu_env.py``'s 1B-class build and ``bench_train.py --device cuda``'s whole
path. Nothing a GPU measures is imitated: where the benchmark reads ``torch.cuda``'s memory counters they are
stubbed, and only what the CPU computes (losses, the plan, the report's fields) is checked.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from finetune_runs import SHORT_RUN, run_tune_in_process

REPO = Path(__file__).resolve().parents[2]


def import_from(folder: Path, name: str):
    """A test module or script by name, from ``folder`` (the GPU suite's conftest puts these folders on the path)."""
    for path in (folder, REPO / "tests" / "unit" / "models", REPO / "tests" / "integration"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    return importlib.import_module(name)


def validate(*overrides: str) -> None:
    result = run_tune_in_process(["validate", "--config", "tiny/full", *overrides])
    assert result.returncode == 0, result.stderr[-3000:]


def test_tune_run_cuda_overrides_validate_and_its_plan_helper_runs(tmp_path: Path, embedded_checkpoint: Path) -> None:
    gpu_test = import_from(REPO / "tests" / "gpu", "test_tune_run_cuda")
    documents = tmp_path / "documents.txt"
    documents.write_text("\n\n".join(" ".join(["alpha", "river", "stone"] * 300) for _ in range(4)) + "\n")
    planned = {}
    for packed in (False, True):
        for ac in sorted(gpu_test.AC):
            args = gpu_test.overrides(tmp_path / "out", embedded_checkpoint, documents, packed, ac)
            validate(*args)
            if packed:  # the plan of a packed bf16 CUDA run (varlen_attn's K/V copies counted where torch makes them)
                planned[ac] = gpu_test.planned_step_bytes(args)
    # llama_small (32 M parameters) in bf16 with AdamW: more than its weights, gradients and bf16 states (8 bytes a
    # parameter); per-op AC keeps the matmuls' outputs, which full AC recomputes.
    assert all(value > 8 * 32e6 for value in planned.values()), planned
    assert planned["full"] < planned["per_op"], planned


@pytest.mark.parametrize("overrides", [("fsdp.cpu_offload=true",),
                                       ("fsdp.cpu_offload=true", "optimizer_in_bwd=true", "clip_grad_norm=null"),
                                       ("enable_activation_offloading=true",)],
                         ids=["cpu_offload", "cpu_offload_in_backward", "activation_offloading"])
def test_offload_cuda_overrides_validate(overrides: tuple[str, ...], tmp_path: Path) -> None:
    offload_test = import_from(REPO / "tests" / "integration", "test_offload")
    validate(*SHORT_RUN, f"output_dir={tmp_path / 'out'}", *offload_test.CUDA_RUN, *overrides)


def test_gpu_env_build_runs_the_recipe_build() -> None:
    gpu_env = import_from(REPO / "scripts", "gpu_env")
    seconds = gpu_env.build_seconds("llama_tiny", device=torch.device("cpu"))
    assert 0 < seconds < 600


def test_bench_train_cuda_path_runs_with_the_memory_counters_stubbed(tmp_path: Path, monkeypatch) -> None:
    """The gpu_check's setting (packed rows, bf16, AC full and none), tiny and eager."""
    bench_train = import_from(REPO / "scripts", "bench_train")
    monkeypatch.setattr(bench_train, "CUDA_DEVICE", torch.device("cpu"))
    stubs = {"is_available": lambda: True, "synchronize": lambda *a, **k: None, "empty_cache": lambda *a, **k: None,
             "reset_peak_memory_stats": lambda *a, **k: None, "max_memory_allocated": lambda *a, **k: 2**30,
             "memory_allocated": lambda *a, **k: 2**20, "memory_reserved": lambda *a, **k: 2**21,
             "max_memory_reserved": lambda *a, **k: 2**31, "set_sync_debug_mode": lambda *a, **k: None,
             "get_device_name": lambda *a, **k: "NVIDIA H100 80GB HBM3",
             "get_device_properties": lambda *a, **k: type("Properties", (), {"total_memory": 80 * 2**30})}
    for name, stub in stubs.items():
        monkeypatch.setattr(torch.cuda, name, stub)
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "gpu_bench_train.json"
    bench_train.main(["--device", "cuda", "--model", "llama_tiny", "--batch-size", "2", "--seq-len", "64",
                      "--steps", "1", "--warmup", "1", "--settings", "full,none", "--compile", "false",
                      "--out-json", str(out), "--packed"])
    report = json.loads(out.read_text())
    assert report["config"]["packed"] is True and report["config"]["peak_tflops"] == 989.0
    assert report["config"]["alloc_conf"] == "expandable_segments:True"  # as tune run's, recorded
    results = {r["setting"]: r for r in report["results"]}
    assert sorted(results) == ["full", "none"]
    for r in results.values():
        assert len(r["losses"]) == 2 and all(math.isfinite(loss) for loss in r["losses"])
        assert r["recompiles"] == 0 and r["planned_step_gib"] > 0 and r["mfu"] > 0
        assert r["mfu"] <= r["mfu_whole_rows"]  # equal here: rows of 64 tokens hold one document each
        assert (r["fixed_allocated_gib"], r["fixed_reserved_gib"]) == (2**-10, 2**-9)
    # The same weights and batches under either AC setting: the first step's loss is the same.
    assert results["full"]["losses"][0] == pytest.approx(results["none"]["losses"][0], rel=1e-2)
    assert results["full"]["planned_step_gib"] < results["none"]["planned_step_gib"]


def test_mfu_counts_each_packed_documents_attention_not_the_whole_row() -> None:
    """``bench_train``'s FLOPs of a step: 6 per parameter and token, and attention per document, sum(L_i^2) a
    layer and query head (``12 x head_dim`` each); ``whole_rows`` is the count of the H100 figures, row_len^2."""
    bench_train = import_from(REPO / "scripts", "bench_train")
    from torchtune_ac.models.llama import Llama, LlamaArgs

    args = LlamaArgs(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, intermediate_dim=96,
                     max_seq_len=256)
    with torch.device("meta"):
        model = Llama(args)
    (batch,) = bench_train.packed_batches(1, 2, 256, args.vocab_size, seed=0)
    lengths = batch["document_lengths"].tolist()
    assert len(lengths) > 2 and sum(lengths) == 2 * 256
    dense = 6 * sum(p.numel() for p in model.parameters()) * 2 * 256
    per_query_square = 12 * args.n_layers * args.n_heads * args.resolved_head_dim
    assert bench_train.step_model_flops(model, batch) == dense + per_query_square * sum(n * n for n in lengths)
    assert bench_train.step_model_flops(model, batch, whole_rows=True) == dense + per_query_square * 2 * 256**2
