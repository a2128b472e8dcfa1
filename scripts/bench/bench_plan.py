"""How accurate is the memory planner? Its estimates against real CPU training steps, side by side.

    .venv/bin/python scripts/bench/bench_plan.py                      # llama_small and llama_small_32k (~10 min)
    .venv/bin/python scripts/bench/bench_plan.py --models llama_small --seq-len 512
    .venv/bin/python scripts/bench/bench_plan.py --runs     # tune plan against whole tune runs, budget or not, TP 2 too (~16 min)

For each model and every AC setting ``tune plan`` lists (none, per-op, every k-th block, full), with the loss
chunked as the model's default says:
  * saved activations: the planner's estimate against ``measure_saved_activation_bytes`` of a real forward;
  * step peak, 1 process: the estimate against the resident-memory increase (Linux VmHWM) of one real training
    step (after a warm-up step), measured in a fresh process with ``MALLOC_MMAP_THRESHOLD_=131072`` (so RSS
    follows live tensors, as CUDA's ``max_memory_allocated`` does) and, for reference, with glibc's defaults;
  * step peak, 2 processes (FSDP2 on gloo): the estimate for world size 2 against rank 0's increase.
Targets: activations within 10 %, step peaks within 15 %. Writes JSON and prints the table.

With ``--runs``, whole ``tune run`` processes against ``tune plan``, with ``ac_mode: auto`` and a budget and without
one (``scripts/bench/_plan_vs_runs.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import leave_spawned_rank, write_report  # noqa: E402

from torchtune_ac.config.components import Component  # noqa: E402
from torchtune_ac.config.meta_model import build_meta_model  # noqa: E402
from torchtune_ac.memory.chunked_loss import loss_objective  # noqa: E402
from torchtune_ac.memory.plan import MemoryConfig, MemoryPlan, resolve_memory_plan  # noqa: E402
from torchtune_ac.memory.features import MemorySettings  # noqa: E402
from torchtune_ac.memory.planner import Workload, candidate_plans, describe_setting, estimate_memory  # noqa: E402
from torchtune_ac.runtime.dtypes import DType  # noqa: E402
from torchtune_ac.activation_checkpointing import ACConfig, resolve_ac_plan  # noqa: E402
from torchtune_ac.training.objective import IGNORE_INDEX  # noqa: E402
from torchtune_ac.runtime.parallelism import Parallelism  # noqa: E402

MiB = 2**20
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
TARGETS = {"activations": 0.10, "peak": 0.15}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-5)


def component(name: str) -> Component:
    return Component(key="model", path=f"torchtune_ac.models.{name}")


def meta_model(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return component(name).instantiate()


def plans_of(name: str) -> list:
    return candidate_plans(len(meta_model(name).layers))


def loss_chunks_of(name: str) -> int:
    """The model's default loss chunks, as a run resolves them (8 for a 32k vocabulary, else 1)."""
    return resolve_memory_plan(ACConfig(), MemoryConfig(), meta_model(name), clip_grad_norm=None).settings.loss_chunks


def batch(name: str, batch_size: int, seq_len: int, rank: int = 0) -> list[dict[str, torch.Tensor]]:
    vocab = meta_model(name).args.vocab_size
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (batch_size, seq_len), generator=generator)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
    return [{"tokens": tokens, "labels": labels}]


def measure_steps(name: str, settings, batch_size: int, seq_len: int, chunks: int, rank: int = 0,
                  world_size: int = 1) -> list[int]:
    """Each setting's RSS increase during one training step after a warm-up step (in this process)."""
    import gc

    import psutil
    from _measure import return_freed_memory_to_os, track_peak_rss

    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.run.assemble import AssemblyPlan, build_training
    from torchtune_ac.runtime.distributed import DistributedContext
    from torchtune_ac.parallel.fsdp import FSDPConfig
    from torchtune_ac.training.step import train_step

    ctx = DistributedContext(rank, world_size, rank, torch.device("cpu"))
    data = batch(name, batch_size, seq_len, rank)
    out = []
    n_layers = len(meta_model(name).layers)
    for mode, option in settings:
        plan = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=mode, ac_option=option, n_layers=n_layers)
        model = build_training(build_meta_model(component(name)),
                               AssemblyPlan(dtype=DType.FP32, memory=MemoryPlan(ac=plan),
                                            seed=0), ctx=ctx).model
        optimizer = build_optimizer(adamw, model, in_backward=False)
        train_step(model, optimizer, data, ctx=ctx, objective=loss_objective(chunks))
        return_freed_memory_to_os()
        if world_size > 1:
            torch.distributed.barrier()
        before = psutil.Process().memory_info().rss
        with track_peak_rss() as peak:
            train_step(model, optimizer, data, ctx=ctx, objective=loss_objective(chunks))
        out.append(peak.peak_bytes - before)
        del model, optimizer
        gc.collect()
        return_freed_memory_to_os()
    return out


def _fsdp_rank(rank: int, store: str, args: dict, out: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        measured = measure_steps(args["model"], args["settings"], args["batch_size"], args["seq_len"],
                                 args["chunks"], rank=rank, world_size=2)
        if rank == 0:
            Path(out).write_text(json.dumps(measured))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    leave_spawned_rank()  # reached only when the work above succeeded


def worker(argv: list[str]) -> None:
    """``--worker single|fsdp JSON``: measure in this (fresh) process and print the JSON result."""
    kind, args = argv[0], json.loads(argv[1])
    if kind == "single":
        print(json.dumps(measure_steps(args["model"], args["settings"], args["batch_size"], args["seq_len"],
                                       args["chunks"])))
        return
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out.json"
        mp.spawn(_fsdp_rank, args=(f"{tmp}/store", args, out), nprocs=2, join=True)
        print(Path(out).read_text())


def run_worker(kind: str, args: dict, extra_env: dict) -> list[int]:
    env = {**os.environ, **extra_env, "OMP_NUM_THREADS": "1" if kind == "fsdp" else os.environ.get("OMP_NUM_THREADS", "2")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(args)], capture_output=True,
                            text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def measured_saved_activations(name: str, settings, batch_size: int, seq_len: int, chunks: int) -> list[int]:
    from _measure import measure_saved_activation_bytes

    from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
    from torchtune_ac.training.step import micro_batch_loss

    data = batch(name, batch_size, seq_len)[0]
    out = []
    for mode, option in settings:
        torch.manual_seed(0)
        model = component(name).instantiate()
        setup_activation_checkpointing(model, ac_mode=mode, ac_option=option)
        out.append(measure_saved_activation_bytes(lambda b: micro_batch_loss(model, b, loss_objective(chunks)), data,
                                                  exclude=list(model.parameters())))
    return out


def run_benchmark(args: argparse.Namespace) -> dict:
    rows = []
    for name in args.models:
        plans = plans_of(name)
        settings = [(p.mode.value, p.option) for p in plans]
        chunks = loss_chunks_of(name)
        estimates = {}
        for world in (1, 2):
            workload = Workload(args.batch_size, args.seq_len, parallelism=Parallelism(world), settings=MemorySettings(loss_chunks=chunks))
            start = time.perf_counter()
            estimates[world] = estimate_memory(component(name).instantiate, adamw, workload, plans=plans)
            print(f"{name}: planned {len(plans)} settings for {world} process(es) in "
                  f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
        spec = {"model": name, "settings": settings, "batch_size": args.batch_size, "seq_len": args.seq_len,
                "chunks": chunks}
        saved = measured_saved_activations(name, settings, args.batch_size, args.seq_len, chunks)
        single = run_worker("single", spec, MMAP_ENV)
        single_glibc = run_worker("single", spec, {})
        fsdp = run_worker("fsdp", spec, MMAP_ENV)
        for i, plan in enumerate(plans):
            one, two = estimates[1][i], estimates[2][i]
            rows.append({
                "model": name, "setting": describe_setting(plan), "loss_chunks": chunks,
                "saved_estimate_mib": one.saved_activations / MiB, "saved_measured_mib": saved[i] / MiB,
                "peak1_estimate_mib": one.step_peak / MiB, "peak1_measured_mib": single[i] / MiB,
                "peak1_glibc_default_mib": single_glibc[i] / MiB,
                "peak2_estimate_mib": two.step_peak / MiB, "peak2_measured_mib": fsdp[i] / MiB,
            })
    for row in rows:
        row["saved_error"] = row["saved_estimate_mib"] / row["saved_measured_mib"] - 1
        row["peak1_error"] = row["peak1_estimate_mib"] / row["peak1_measured_mib"] - 1
        row["peak2_error"] = row["peak2_estimate_mib"] / row["peak2_measured_mib"] - 1
    met = all(abs(r["saved_error"]) <= TARGETS["activations"] and abs(r["peak1_error"]) <= TARGETS["peak"]
              and abs(r["peak2_error"]) <= TARGETS["peak"] for r in rows)
    return {"batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": "fp32", "optimizer": "AdamW",
            "rows": rows, "targets": TARGETS, "all_targets_met": met, "torch": torch.__version__,
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def format_table(report: dict) -> str:
    lines = [f"batch {report['batch_size']} x {report['seq_len']} per process, fp32, AdamW; MiB; error = estimate / "
             "measured - 1",
             f"{'model':<16} {'setting':<16} {'saved est':>9} {'measured':>8} {'err':>6} | {'1 proc est':>10} "
             f"{'measured':>8} {'err':>6} {'glibc dflt':>10} | {'2 procs est':>11} {'measured':>8} {'err':>6}"]
    for r in report["rows"]:
        lines.append(
            f"{r['model']:<16} {r['setting']:<16} {r['saved_estimate_mib']:>9.0f} {r['saved_measured_mib']:>8.0f} "
            f"{r['saved_error']:>+6.1%} | {r['peak1_estimate_mib']:>10.0f} {r['peak1_measured_mib']:>8.0f} "
            f"{r['peak1_error']:>+6.1%} {r['peak1_glibc_default_mib']:>10.0f} | {r['peak2_estimate_mib']:>11.0f} "
            f"{r['peak2_measured_mib']:>8.0f} {r['peak2_error']:>+6.1%}")
    lines.append(f"targets (activations within 10 %, peaks within 15 %): {'all met' if report['all_targets_met'] else 'NOT all met'}")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", type=lambda s: s.split(","), default=["llama_small", "llama_small_32k"])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--out-json", type=Path, default=None,
                        help="default: bench_results/bench_plan.json (--runs: bench_plan_runs.json)")
    parser.add_argument("--runs", action="store_true", help="tune plan against whole tune runs, budget or not")
    args = parser.parse_args(argv)
    args.out_json = args.out_json or REPO / "bench_results" / ("bench_plan_runs.json" if args.runs else "bench_plan.json")
    return args


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return
    args = parse_args()
    if args.runs:
        import _plan_vs_runs

        started = time.strftime("%Y-%m-%d %H:%M:%S")
        rows = _plan_vs_runs.run_plan_vs_runs(seed=0, progress=lambda text: print(text, file=sys.stderr, flush=True))
        report = {"command": "scripts/bench/bench_plan.py " + " ".join(sys.argv[1:]), "date": started, "rows": rows,
                  "steps_per_run": _plan_vs_runs.STEPS, "torch": torch.__version__, "machine": platform.machine(),
                  "cpu_count": os.cpu_count(), "threads": torch.get_num_threads()}
        write_report(report, _plan_vs_runs.format_rows(rows), args.out_json)
        return
    report = run_benchmark(args)
    write_report(report, format_table(report), args.out_json)


if __name__ == "__main__":
    main()
