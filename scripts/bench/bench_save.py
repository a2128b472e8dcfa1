"""Benchmark saving an FSDP2-sharded model as a Hugging Face checkpoint: rank 0's memory and time.

    .venv/bin/python scripts/bench/bench_save.py                  # models of 0.4, 0.8, 1.5 GB (fp32), 2 gloo processes
    .venv/bin/python scripts/bench/bench_save.py --layers 4,8 --shard-size 50MB

For models of several depths (dim 1024, vocabulary 32000, so a 125 MiB embedding), two ways of writing the same
checkpoint, each in a fresh pair of processes:
  * full_gather: gather the full state dict to rank 0 (``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)``), then write it (what recipes commonly do);
  * per_shard: ``torchtune_ac.models.save_hf`` on every rank, which gathers, writes and frees one output
    safetensors shard at a time.
For each it reports rank 0's peak resident memory during the save above its resident memory just before (Linux
VmHWM, reset before the save), the wall time of the save, and checks that both checkpoints hold equal tensors.

Writes a JSON file and a chart.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import leave_spawned_rank, pyplot, save_figure, write_report  # noqa: E402
from _measure import track_peak_rss  # noqa: E402

from torchtune_ac.activation_checkpointing.config import ACConfig  # noqa: E402
from torchtune_ac.memory.plan import MemoryPlan  # noqa: E402
from torchtune_ac.models import Llama, LlamaArgs, load_hf, save_hf, save_hf_state_dict  # noqa: E402
from torchtune_ac.run.assemble import AssemblyPlan, build_training  # noqa: E402
from torchtune_ac.runtime.distributed import DistributedContext  # noqa: E402
from torchtune_ac.runtime.dtypes import DType  # noqa: E402

MODES = ("full_gather", "per_shard")
WORLD_SIZE = 2
MIB = 2**20


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", default="6,12,24", help="comma-separated model depths (transformer blocks)")
    parser.add_argument("--shard-size", default="100MB", help="max_shard_size of the written checkpoint")
    parser.add_argument("--out-json", type=Path, default=REPO / "bench_results" / "bench_save.json")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "images" / "bench_save.png")
    return parser.parse_args(argv)


def depths(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"--layers {text!r}: expected comma-separated positive integers, e.g. 6,12,24")
    return values


def model_args(layers: int) -> LlamaArgs:
    return LlamaArgs(vocab_size=32000, dim=1024, n_layers=layers, n_heads=16, n_kv_heads=8,
                     intermediate_dim=2816, max_seq_len=2048)


def sharded_model(args: LlamaArgs) -> torch.nn.Module:
    """Built on meta and sharded as a run shards it (``build_training``: FSDP2 per block, then the root), each
    rank's shard filled from a per-rank seed (the values do not matter to a save, only their bytes)."""
    with torch.device("meta"):
        model = Llama(args)
    ctx = DistributedContext(dist.get_rank(), WORLD_SIZE, 0, torch.device("cpu"))
    plan = AssemblyPlan(DType.FP32, MemoryPlan(ACConfig().resolve(args.n_layers)))
    model = build_training(model, plan, ctx=ctx, load_weights=False).model
    generator = torch.Generator().manual_seed(dist.get_rank())
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().normal_(0.0, 0.02, generator=generator)
    return model


def save_rank(rank: int, store: str, mode: str, layers: int, shard_size: str, out_dir: str, result: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(minutes=10))
    try:
        model = sharded_model(model_args(layers))
        gc.collect()
        before = psutil.Process().memory_info().rss
        dist.barrier()
        start = time.perf_counter()
        with track_peak_rss() as peak:
            if mode == "full_gather":
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                            cpu_offload=True))
                if rank == 0:
                    save_hf_state_dict(full, model.args, out_dir, max_shard_size=shard_size)
                del full
            else:
                save_hf(model, out_dir, max_shard_size=shard_size)
        dist.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            Path(result).write_text(json.dumps({
                "mode": mode, "peak_rss_growth_mib": (peak.peak_bytes - before) / MIB, "rss_method": peak.method,
                "seconds": seconds, "rank0_shard_mib": sum(p.to_local().nbytes for p in model.parameters()) / MIB,
            }))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_spawned_rank()  # reached only when the work above succeeded


def run_mode(mode: str, layers: int, shard_size: str, work: Path) -> dict:
    store, result = work / f"store-{mode}", work / f"result-{mode}.json"
    mp.spawn(save_rank, args=(str(store), mode, layers, shard_size, str(work / mode), str(result)),
             nprocs=WORLD_SIZE, join=True)
    return json.loads(result.read_text())


def model_mib(layers: int) -> float:
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in Llama(model_args(layers)).parameters()) / MIB


def format_table(report: dict) -> str:
    """The results as a fixed-width text table."""
    lines = [f"\n{report['world_size']} ranks, max_shard_size {report['shard_size']}; both ways write equal tensors",
             f"{'model':>10} {'mode':<12} {'rank-0 peak RSS growth':>24} {'save time':>10}"]
    for r in report["results"]:
        lines.append(f"{r['model_mib']:>6.0f} MiB {r['mode']:<12} {r['peak_rss_growth_mib']:>20.0f} MiB "
                     f"{r['seconds']:>8.1f} s")
    return "\n".join(lines)


def write_chart(report: dict, path: Path) -> None:
    plt = pyplot()

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    sizes = sorted({r["model_mib"] for r in rows})
    ax.plot(sizes, sizes, color="black", linestyle="--", linewidth=1, label="the whole model")
    for mode, color in zip(MODES, ("#999999", "#3b7dd8")):
        points = sorted((r["model_mib"], r["peak_rss_growth_mib"]) for r in rows if r["mode"] == mode)
        ax.plot(*zip(*points), marker="o", color=color, label=mode)
        for x, y in points:
            ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("model size, fp32 (MiB)")
    ax.set_ylabel("rank 0: peak RSS during the save,\nabove before (MiB)")
    ax.set_title(f"Saving an FSDP2 model from {report['world_size']} ranks as Hugging Face safetensors\n"
                 f"(max_shard_size {report['shard_size']}; embedding 125 MiB)", fontsize=10)
    ax.set_xlim(0, max(sizes) * 1.08)
    ax.set_ylim(0, max(max(sizes), *(r["peak_rss_growth_mib"] for r in rows)) * 1.12)
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    results = []
    for layers in depths(args.layers):
        with tempfile.TemporaryDirectory(prefix="bench_save-") as tmp:
            work = Path(tmp)
            for mode in MODES:
                print(f"{layers} layers ({model_mib(layers):.0f} MiB): {mode} ...", flush=True)
                results.append({"layers": layers, "model_mib": model_mib(layers),
                                **run_mode(mode, layers, args.shard_size, work)})
            saved = [load_hf(work / mode).state_dict() for mode in MODES]
            assert saved[0].keys() == saved[1].keys()
            assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0]), "checkpoints differ"
    report = {
        "shard_size": args.shard_size, "world_size": WORLD_SIZE, "torch": torch.__version__,
        "cpu_count": psutil.cpu_count(), "machine": platform.machine(), "results": results,
    }
    write_report(report, format_table(report), args.out_json, write_chart, args.out_png)


if __name__ == "__main__":
    main()
