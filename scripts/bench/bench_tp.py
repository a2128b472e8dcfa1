"""Benchmark tensor parallelism: per-process activation memory on CPU, tokens per second on GPUs.

    .venv/bin/python scripts/bench/bench_tp.py                             # CPU, gloo: TP 1 vs TP 2, one long sequence
    .venv/bin/python scripts/bench/bench_tp.py --seq-len 4096 --repeats 1  # shorter
    torchrun --nproc_per_node 2 scripts/bench/bench_tp.py --device cuda    # 2 GPUs: TP 2 vs FSDP 2 on llama3_2_1b

CPU (the default): a tiny Llama (``--dim``, ``--layers``) at one long sequence, trained with the chunked loss (the
loss tensor parallelism computes on vocabulary shards), in one process (TP 1) and in two gloo processes splitting
every layer (TP 2, FSDP2 over a shard dimension of 1). With ``--loss``: a vocabulary of 32768 instead, whose logits
dominate, each layout trained with the whole logits (gathered whole on every rank under TP) and with the chunked
loss (computed on the vocabulary shards). Each setting runs in fresh processes, A/B/B/A over ``--repeats`` rounds;
per process it reports

  * the bytes the forward keeps for backward (every tensor autograd saves, a DTensor counted by its local piece):
    the activations, which tensor and sequence parallelism split;
  * the step's peak resident memory above the resident memory before it (activations, gradients, temporaries).

Expect the activations of TP 2 to be about half of TP 1's: each rank keeps its half of the sequence for the norms
and residuals, its half of the heads and MLP columns, but the whole sequence entering attention and the MLP (the
gathered input that the column-split projections save for their weight gradients), so somewhat more than half.

GPU (``--device cuda``, under torchrun with 2 processes, one GPU each): ``--model`` (llama3_2_1b) in bf16 from
random weights, ``--batch-size`` x ``--seq-len`` tokens per data-parallel rank, full AC, compiled blocks, for two
layouts of the same 2 GPUs, alternating a timed step of each: FSDP 2 (each GPU its own sequences) and TP 2 (both
GPUs on the same sequences, half as many distinct tokens per step). Reports tokens/s per GPU and each step's peak
memory above what was allocated before it. Not run yet: no machine with 2 GPUs was at hand when this was written;
``--throughput`` on a CPU (gloo, a tiny model) runs the same code as a check:

    torchrun --nproc_per_node 2 scripts/bench/bench_tp.py --throughput --model llama_tiny --seq-len 256 --steps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import psutil
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import leave_spawned_rank, write_report  # noqa: E402
from _measure import return_freed_memory_to_os, track_peak_rss  # noqa: E402

from torchtune_ac import models  # noqa: E402
from torchtune_ac.memory.chunked_loss import ChunkedCrossEntropyObjective, loss_objective  # noqa: E402
from torchtune_ac.memory.plan import MemoryPlan  # noqa: E402
from torchtune_ac.models.families import family_of, transformer_blocks  # noqa: E402
from torchtune_ac.models.families.llama import FAMILY as LLAMA  # noqa: E402
from torchtune_ac.models.families.llama import LLAMA_TINY  # noqa: E402
from torchtune_ac.run.assemble import AssembledModel, AssemblyPlan, build_training  # noqa: E402
from torchtune_ac.runtime.allocator import use_expandable_segments_by_default  # noqa: E402
from torchtune_ac.runtime.distributed import DistributedContext  # noqa: E402
from torchtune_ac.runtime.parallelism import Parallelism  # noqa: E402
from torchtune_ac.runtime.dtypes import DType  # noqa: E402
from torchtune_ac.activation_checkpointing.config import resolve_ac_plan  # noqa: E402
from torchtune_ac.training.objective import IGNORE_INDEX  # noqa: E402
from torchtune_ac.training.step import train_step  # noqa: E402

OUT_JSON = REPO / "bench_results" / "bench_tp.json"


def build(meta_model: torch.nn.Module, ctx: DistributedContext, dtype: DType, mesh: Any, make_optimizer, *,
          ac_mode: str = "none", compile_blocks: bool = False) -> AssembledModel:
    """The model through the run's order (``build_training``: AC -> compile -> TP -> FSDP2 -> allocate ->
    initialise, then the optimizer), split as ``ctx.parallelism`` says over ``mesh`` (None: one plain process)."""
    ac = resolve_ac_plan(enable_activation_checkpointing=None, ac_mode=ac_mode, ac_option=None,
                         n_layers=len(transformer_blocks(meta_model)))
    plan = AssemblyPlan(dtype=dtype, memory=MemoryPlan(ac), compile=compile_blocks, seed=0)
    return build_training(meta_model, plan, ctx=ctx, mesh=mesh, make_optimizer=make_optimizer)


def make_batch(vocab_size: int, rows: int, seq_len: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    return {"tokens": tokens.to(device), "labels": labels.to(device),
            "target_count": torch.tensor(rows * (seq_len - 1))}


# ---------------------------------------------------------------------------------------------------------------
# CPU: activation memory per process
# ---------------------------------------------------------------------------------------------------------------


def cpu_rank(rank: int, world_size: int, store: Optional[str], options: dict, out: str) -> None:
    """Measure one layout in this process: TP ``world_size`` (1: one plain process)."""
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    args = dataclasses.replace(LLAMA_TINY, vocab_size=options["vocab"], dim=options["dim"], n_layers=options["layers"],
                               intermediate_dim=options["dim"] * 11 // 4, max_seq_len=options["seq_len"])
    with torch.device("meta"):
        meta = LLAMA.build(args)
    parallelism = Parallelism(world_size, tensor=world_size)  # one tensor-parallel group
    mesh = parallelism.build_mesh("cpu") if world_size > 1 else None
    ctx = DistributedContext(rank, world_size, 0, cpu, parallelism=parallelism)
    assembled = build(meta, ctx, DType.FP32, mesh, lambda params: torch.optim.AdamW(params, lr=1e-4))
    model, stepper = assembled.model, assembled.stepper
    objective = loss_objective(options["loss_chunks"])
    batch = make_batch(args.vocab_size, 1, options["seq_len"], cpu, seed=0)
    train_step(model, stepper, [batch], ctx=ctx, objective=objective)  # warm-up: optimizer state, caches
    params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}
    activations = _saved_without(model, objective, batch, params)
    model.zero_grad(set_to_none=True)
    gc.collect()
    return_freed_memory_to_os()
    if world_size > 1:
        dist.barrier()
    before = psutil.Process().memory_info().rss
    with track_peak_rss() as peak:
        train_step(model, stepper, [batch], ctx=ctx, objective=objective)
    result = {"rank": rank, "activations_bytes": activations, "step_peak_rss_bytes": peak.peak_bytes - before}
    Path(f"{out}.{rank}").write_text(json.dumps(result))
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
        leave_spawned_rank()


def _saved_without(model: torch.nn.Module, objective: Any, batch: dict, params: set[int]) -> int:
    """Bytes saved for backward by one forward (the chunked loss included), the parameters not counted."""
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
        local = local.elem if isinstance(local, AsyncCollectiveTensor) else local  # a collective's pending result
        storage = local.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = objective(model, batch)
    del loss
    model.zero_grad(set_to_none=True)
    return sum(saved.values())


def run_cpu_layout(tp: int, options: dict) -> list[dict]:
    """Run layout ``tp`` in fresh processes; each rank's measurement."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result"
        if tp == 1:
            ctx = mp.get_context("spawn")
            process = ctx.Process(target=cpu_rank, args=(0, 1, None, options, out))
            process.start()
            process.join()
            if process.exitcode != 0:
                raise RuntimeError(f"TP 1 measurement failed (exit {process.exitcode})")
        else:
            mp.spawn(cpu_rank, args=(tp, f"{tmp}/store", options, out), nprocs=tp, join=True)
        return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(tp)]


def run_cpu(settings: dict[str, tuple[int, dict]], repeats: int) -> dict:
    """Each setting (name -> (TP degree, options)) in fresh processes, in order then reversed, ``repeats`` rounds;
    the median per process of each."""
    names = list(settings)
    order = [name for round_ in range(repeats) for name in (names if round_ % 2 == 0 else names[::-1])]
    measured: dict[str, list[list[dict]]] = {name: [] for name in names}
    for name in order:
        tp, options = settings[name]
        measured[name].append(run_cpu_layout(tp, options))
    return {name: {
        "tp": settings[name][0],
        **settings[name][1],
        "activations_mib_per_process": statistics.median(r["activations_bytes"] for run in runs for r in run) / 2**20,
        "step_peak_rss_mib_per_process": statistics.median(r["step_peak_rss_bytes"] for run in runs for r in run)
        / 2**20,
        "runs": runs,
    } for name, runs in measured.items()}


# ---------------------------------------------------------------------------------------------------------------
# GPU: tokens per second, TP 2 against FSDP 2 (under torchrun, 2 processes)
# ---------------------------------------------------------------------------------------------------------------


def run_throughput(options: dict) -> Optional[dict]:
    """Tokens/s of FSDP 2 and TP 2 on the same 2 processes, a timed step of each in turn (under torchrun). On CUDA
    (NCCL, one GPU each) what it is for; on a CPU (gloo) a check that the comparison runs."""
    cuda = options["device"] == "cuda"
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != 2:
        raise SystemExit("--throughput: start 2 processes (torchrun --nproc_per_node 2), one GPU each on CUDA")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    builder = getattr(models, options["model"])
    objective = ChunkedCrossEntropyObjective(8)
    dtype = DType.BF16 if cuda else DType.FP32
    layouts = {}
    for name, tp in (("fsdp2", 1), ("tp2", 2)):
        with torch.device("meta"):
            meta = builder(max_seq_len=options["seq_len"])
        parallelism = Parallelism(world_size, tensor=tp)
        mesh = parallelism.build_mesh(device.type)
        # The context of the layout: under TP 2 the two ranks are one group (its token counts are not doubled).
        ctx = DistributedContext(rank, world_size, rank, device, parallelism=parallelism)
        assembled = build(meta, ctx, dtype, mesh, lambda params: torch.optim.AdamW(params, lr=1e-5, fused=cuda),
                          ac_mode="full", compile_blocks=options["compile"])
        # FSDP 2: each rank its own rows; TP 2: both ranks the same rows (one data-parallel rank).
        dp_rank = rank if tp == 1 else 0
        layouts[name] = {"model": assembled.model, "stepper": assembled.stepper, "dp_rank": dp_rank, "times": [],
                         "step_peak": 0, "ctx": ctx}
    vocab = family_of(layouts["fsdp2"]["model"]).args_of(layouts["fsdp2"]["model"]).vocab_size
    for step in range(options["warmup"] + options["steps"]):
        for name in (("fsdp2", "tp2") if step % 2 == 0 else ("tp2", "fsdp2")):
            layout = layouts[name]
            batch = make_batch(vocab, options["batch_size"], options["seq_len"], device,
                               seed=step * 2 + layout["dp_rank"])
            synchronize()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            start = time.perf_counter()
            train_step(layout["model"], layout["stepper"], [batch], ctx=layout["ctx"], objective=objective)
            synchronize()
            if step >= options["warmup"]:
                layout["times"].append(time.perf_counter() - start)
                if cuda:  # above what was allocated before it: both models' shards and states stay resident
                    layout["step_peak"] = max(layout["step_peak"], torch.cuda.max_memory_allocated(device) - before)
    report = {"device": torch.cuda.get_device_name(device) if cuda else platform.machine(), "processes": world_size,
              **options}
    for name, layout in layouts.items():
        step_time = statistics.median(layout["times"])
        # Distinct tokens trained per step over both processes: FSDP 2 two batches, TP 2 one.
        tokens = options["batch_size"] * options["seq_len"] * (2 if name == "fsdp2" else 1)
        report[name] = {"median_step_s": step_time, "tokens_per_s_per_gpu": tokens / step_time / world_size,
                        "step_peak_gib": layout["step_peak"] / 2**30}
    report["tp2_over_fsdp2"] = report["tp2"]["tokens_per_s_per_gpu"] / report["fsdp2"]["tokens_per_s_per_gpu"]
    dist.destroy_process_group()
    return report if rank == 0 else None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="CPU: 8192 (--loss: 2048); GPU: 4096")
    parser.add_argument("--dim", type=int, default=256, help="CPU: the tiny model's width")
    parser.add_argument("--layers", type=int, default=2, help="CPU: the tiny model's blocks")
    parser.add_argument("--repeats", type=int, default=2, help="CPU: rounds of the settings (A/B/B/A)")
    parser.add_argument("--loss", action="store_true",
                        help="CPU: the loss instead: whole logits (gathered) and the chunked loss (on vocabulary "
                             "shards) at TP 1 and TP 2, vocabulary 32768")
    parser.add_argument("--throughput", action="store_true",
                        help="tokens/s of TP 2 against FSDP 2 under torchrun (the default with --device cuda; on a "
                             "CPU, a check that it runs: --model llama_tiny --seq-len 256)")
    parser.add_argument("--no-compile", action="store_true", help="GPU: eager blocks (compiled by default)")
    parser.add_argument("--model", default="llama3_2_1b", help="throughput: builder name in torchtune_ac.models")
    parser.add_argument("--batch-size", type=int, default=2, help="GPU: rows per data-parallel rank")
    parser.add_argument("--warmup", type=int, default=3, help="GPU: untimed steps of each layout (compile)")
    parser.add_argument("--steps", type=int, default=10, help="GPU: timed steps of each layout")
    parser.add_argument("--out-json", type=Path, default=None, help=f"default {OUT_JSON} (--loss: bench_tp_loss.json; "
                        "throughput: bench_tp_<device>_throughput.json)")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    use_expandable_segments_by_default()  # as `tune run` does, before CUDA's allocator is first used
    args = parse_args(argv)
    if args.throughput or args.device == "cuda":
        options = {"device": args.device, "model": args.model, "batch_size": args.batch_size,
                   "seq_len": args.seq_len or 4096, "warmup": args.warmup, "steps": args.steps,
                   "compile": args.device == "cuda" and not args.no_compile}
        report = run_throughput(options)
        if report is None:
            return
        table = "\n".join(f"{name:6s} {report[name]['tokens_per_s_per_gpu']:10.0f} tokens/s per process, step peak "
                          f"{report[name]['step_peak_gib']:.2f} GiB" for name in ("fsdp2", "tp2"))
        table += f"\nTP 2 / FSDP 2: {report['tp2_over_fsdp2']:.2f}"
        write_report(report, table, args.out_json or OUT_JSON.with_name(f"bench_tp_{args.device}_throughput.json"))
        return
    base = {"dim": args.dim, "layers": args.layers, "seq_len": args.seq_len or (2048 if args.loss else 8192)}
    if args.loss:
        # The output layer and the loss: a vocabulary large enough that the logits dominate.
        base["vocab"] = 32768
        settings = {f"tp{tp}_{kind}": (tp, {**base, "loss_chunks": chunks})
                    for tp in (1, 2) for kind, chunks in (("whole_logits", 1), ("chunked", 8))}
    else:
        base["vocab"] = LLAMA_TINY.vocab_size
        settings = {f"tp{tp}": (tp, {**base, "loss_chunks": 8}) for tp in (1, 2)}
    started = time.time()
    report = {
        "command": "scripts/bench/bench_tp.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_before": os.getloadavg(),
        "torch": torch.__version__,
        "settings": run_cpu(settings, args.repeats),
    }
    report["load_average_after"] = os.getloadavg()
    report["wall_s"] = time.time() - started
    measured = report["settings"]
    table = "\n".join(
        f"{name:18s} activations {m['activations_mib_per_process']:8.1f} MiB per process, step peak RSS "
        f"{m['step_peak_rss_mib_per_process']:8.1f} MiB" for name, m in measured.items())
    if not args.loss:
        report["activations_tp2_over_tp1"] = (measured["tp2"]["activations_mib_per_process"]
                                              / measured["tp1"]["activations_mib_per_process"])
        table += f"\nactivations TP 2 / TP 1: {report['activations_tp2_over_tp1']:.3f}"
    out = args.out_json or (OUT_JSON.with_name("bench_tp_loss.json") if args.loss else OUT_JSON)
    write_report(report, table, out)


if __name__ == "__main__":
    main()
