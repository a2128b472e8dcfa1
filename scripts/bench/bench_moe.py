"""Benchmark mixtures of experts on CPU: the experts' compute of one MoE layer (grouped matmul against a loop), and
expert parallelism against FSDP2 on 2 processes.

    .venv/bin/python scripts/bench/bench_moe.py                    # both parts (~5 min on a quiet 2-core machine)
    .venv/bin/python scripts/bench/bench_moe.py --quick            # tiny shapes, to check the script runs
    .venv/bin/python scripts/bench/bench_moe.py --only kernels --experts 128 --top-k 8 --dim 2048 --expert-dim 768
                                                             # Qwen3-30B-A3B's expert shape (minutes)
    .venv/bin/python scripts/bench/bench_moe.py --only kernels --layout gpt_oss --experts 32 --top-k 4 --dim 2880 --expert-dim 2880
    .venv/bin/python scripts/bench/bench_moe.py --only compile --repeats 5
    .venv/bin/python scripts/bench/bench_moe.py --only parallel --repeats 2

1. kernels: all experts in one grouped matmul per projection (``torchtune_ac.models.moe.compute_experts``:
   ``torch._grouped_mm`` on the CPU) against a Python loop over the experts, one matmul each (``loop_experts``),
   forward + backward, in this process (by default 32 experts, 8 per token, 1024 -> 384, 512 tokens).
2. compile: a whole tiny MoE model's step (``qwen3_moe_tiny``) eager against ``compile: true``, under per-op and
   full AC, on 1 process and at EP 2 (2 gloo processes, the exchange inside the compiled blocks), with Dynamo's
   graphs and breaks counted (``--only compile``).
3. parallel: ``tune run --nproc_per_node 2 full_finetune`` on the same Qwen3-MoE (a checkpoint written by
   transformers' ``Qwen3MoeForCausalLM``: 4 layers of 32 experts, 4 per token, dim 256), packed rows, with
   ``expert_parallel_dim: 2`` (each process holds 16 experts of each layer; tokens exchanged by all-to-all) and 1
   (FSDP2 gathers all 32 of a layer on each process), fresh processes A B B A: tokens/s per process (the median
   step after 2 of warm-up, from ``metrics.jsonl``) and rank 0's peak resident set.

Both sides get the same weights and the same tokens, routed by the same random router, and must give the same
outputs and gradients (checked before timing; the grouped path is compared within the rounding of one expert's
reductions). Each round runs both sides in an order that rotates, so that drift of a shared machine lands on
both alike; the median and the fastest run of each are reported, with the grouped path's speed-up. Also timed:
the padded batched-matmul fallback (``grouped_mm``'s path where ``torch._grouped_mm`` does not run).

Writes ``bench_results/bench_moe.json`` and ``docs/images/bench_moe.png``. Timings on a busy machine are noise: take
them on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import leave_spawned_rank, pyplot, save_figure, write_report  # noqa: E402

from torchtune_ac.models import moe  # noqa: E402

LAYOUTS = {
    "qwen3_moe": moe.ExpertLayout(),
    "gpt_oss": moe.ExpertLayout(in_out=True, interleaved=True, bias=True, activation="clamped_swiglu"),
}


def _padded(experts: moe.GroupedExperts, rows: torch.Tensor, plan: moe.Dispatch) -> torch.Tensor:
    """``compute_experts`` through the padded bmm fallback (what runs where ``torch._grouped_mm`` is not chosen)."""
    chosen, experts.kernel = experts.kernel, moe.PADDED_BMM
    try:
        return moe.compute_experts(experts, rows, plan)
    finally:
        experts.kernel = chosen


SIDES: dict[str, Callable] = {"grouped": moe.compute_experts, "loop": moe.loop_experts, "padded_bmm": _padded}


def _setup(args: argparse.Namespace, dtype: torch.dtype) -> tuple[moe.GroupedExperts, torch.Tensor, moe.Dispatch]:
    generator = torch.Generator().manual_seed(0)
    moe_args = moe.MoEArgs(num_experts=args.experts, top_k=args.top_k, expert_dim=args.expert_dim,
                           experts=LAYOUTS[args.layout])
    experts = moe.GroupedExperts(args.dim, moe_args)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    experts = experts.to(dtype)
    tokens = torch.randn(args.tokens, args.dim, generator=generator).to(dtype)
    logits = torch.randn(args.tokens, args.experts, generator=generator)
    _, chosen = moe.route(logits, moe_args.router, args.top_k)
    rows, plan = moe.dispatch(tokens, chosen, args.experts)
    return experts, rows.contiguous(), plan


def _step(compute: Callable, experts: moe.GroupedExperts, rows: torch.Tensor, plan: moe.Dispatch,
          grad: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    experts.zero_grad(set_to_none=True)
    x = rows.detach().requires_grad_()
    out = compute(experts, x, plan)
    out.backward(grad)
    return out.detach(), {"rows": x.grad, **{n: p.grad for n, p in experts.named_parameters()}}


def kernels(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The grouped matmul, the loop and the padded fallback on one layer's experts: same numbers, then timed."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    experts, rows, plan = _setup(args, dtype)
    grad = torch.randn(rows.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    results = {name: _step(compute, experts, rows, plan, grad) for name, compute in SIDES.items()}
    # Same numbers: the outputs bit for bit (each row's products are the same dot products), the gradients within
    # the rounding of an expert's sum over its rows.
    reference_out, reference_grads = results["loop"]
    equal = {}
    for name, (out, grads) in results.items():
        scale = max(float(g.abs().max()) for g in reference_grads.values())
        worst = max(float((grads[k].float() - reference_grads[k].float()).abs().max()) for k in grads)
        equal[name] = {"outputs_equal": bool(torch.equal(out, reference_out)),
                       "max_grad_difference": worst, "grad_scale": scale}
        if worst > 1e-2 * scale:
            raise SystemExit(f"bench_moe: {name} differs from the loop beyond rounding: {worst:.3g} "
                             f"(scale {scale:.3g})")

    times: dict[str, list[float]] = {name: [] for name in SIDES}
    names = list(SIDES)
    for round_index in range(args.repeats):
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            start = time.perf_counter()
            _step(SIDES[name], experts, rows, plan, grad)
            times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    report = {
        "threads": torch.get_num_threads(),
        "shape": {k: getattr(args, k) for k in ("layout", "experts", "top_k", "dim", "expert_dim", "tokens", "dtype")},
        "grouped_mm_runs": experts.kernel == moe.GROUPED,
        "same_numbers": equal,
        "seconds": {name: {"median": median[name], "fastest": min(times[name]), "all": times[name]} for name in times},
        "grouped_speedup_vs_loop": median["loop"] / median["grouped"],
    }
    lines = [f"kernels: {args.layout}: {args.tokens} tokens x top-{args.top_k} of {args.experts} experts "
             f"({args.dim} -> {args.expert_dim}), {args.dtype}, forward + backward, {report['threads']} threads",
             f"{'side':<12}{'median s':>12}{'fastest s':>12}{'outputs equal':>16}{'max grad diff':>16}"]
    for name in SIDES:
        lines.append(f"{name:<12}{median[name]:>12.4f}{min(times[name]):>12.4f}{str(equal[name]['outputs_equal']):>16}"
                     f"{equal[name]['max_grad_difference']:>16.3g}")
    lines.append(f"grouped is {report['grouped_speedup_vs_loop']:.2f}x the loop's speed (median)")
    return report, lines


def _compiled_step(compile_blocks: bool, mode: str, option: Optional[str], tokens: torch.Tensor,
                   ep_mesh: Any = None) -> Callable[[], float]:
    """A tiny Qwen3-MoE (``qwen3_moe_tiny``) with an AC mode, its blocks compiled or not (inductor, as ``compile:
    true`` runs), its experts split over ``ep_mesh`` when given, and a function that runs one forward + backward and
    returns the loss."""
    from torchtune_ac.activation_checkpointing.mechanism import ACMode, ac_plan, apply_ac_plan
    from torchtune_ac.models import qwen3_moe_tiny
    from torchtune_ac.parallel.expert_parallel import apply_expert_parallel

    torch.manual_seed(0)  # every process the same whole weights: each keeps its own experts' share
    model = qwen3_moe_tiny()
    model.init_weights()
    apply_ac_plan(model, ac_plan(ACMode(mode), option, len(model.layers)))
    if compile_blocks:
        for block in model.layers:
            block.compile()
    if ep_mesh is not None:
        apply_expert_parallel(model, ep_mesh)  # after compile, as a run assembles it

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        return float(loss.detach())

    return step


COMPILE_AC = {"per-op": ("selective", "op"), "full": ("full", None)}
COMPILE_EP = 2  # the expert-parallel layout timed beside 1 process


def _compile_tokens(args: argparse.Namespace, rank: int) -> torch.Tensor:
    return torch.randint(0, 100, (args.batch_size, 128 if not args.quick else 32),
                         generator=torch.Generator().manual_seed(rank))


def _time_compile_sides(args: argparse.Namespace, tokens: torch.Tensor, ep_mesh: Any = None) -> dict[str, Any]:
    """Each AC mode's step eager and compiled: losses, times after a warm-up that compiles, Dynamo's counts."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    sides = {}
    for ac, (mode, option) in COMPILE_AC.items():
        for compile_blocks in (False, True):
            torch._dynamo.reset()
            counters.clear()
            step = _compiled_step(compile_blocks, mode, option, tokens, ep_mesh)
            losses = [step() for _ in range(2)]  # warm-up (compiles)
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                losses.append(step())
                times.append(time.perf_counter() - start)
            sides[f"{ac} {'compiled' if compile_blocks else 'eager'}"] = {
                "losses": losses, "median_s": statistics.median(times), "all_s": times,
                "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}
    return sides


def _compile_ep_rank(rank: int, store: str, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=COMPILE_EP)
    torch.set_num_threads(1)
    try:
        mesh = init_device_mesh("cpu", (COMPILE_EP,), mesh_dim_names=("ep",))
        sides = _time_compile_sides(args, _compile_tokens(args, rank), mesh)
        if rank == 0:
            Path(out).write_text(json.dumps(sides))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_spawned_rank()  # reached only when the work above succeeded


def compiled(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """A whole MoE model's step (``qwen3_moe_tiny``), eager against ``compile: true`` (every block compiled, one
    graph each), under per-op and full AC, on 1 process and at EP 2 (2 processes of 1 thread, each its own tokens;
    rank 0's times): same loss, then timed after a warm-up that compiles."""
    import torch.multiprocessing as mp

    tokens = _compile_tokens(args, 0)
    layouts = {"1 process": _time_compile_sides(args, tokens)}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        mp.spawn(_compile_ep_rank, args=(f"{tmp}/store", args, f"{tmp}/out.json"), nprocs=COMPILE_EP, join=True)
        layouts[f"EP {COMPILE_EP}"] = json.loads(Path(f"{tmp}/out.json").read_text())
    report: dict[str, Any] = {"tokens_per_process": list(tokens.shape), "layouts": layouts, "speedup": {}}
    lines = [f"compile: qwen3_moe_tiny, {tokens.shape[0]} x {tokens.shape[1]} tokens a process, forward + backward, "
             f"{args.repeats} timed steps after 2",
             f"{'layout':<12}{'side':<20}{'median s':>12}{'graphs':>8}{'breaks':>8}"]
    for layout, sides in layouts.items():
        for ac in COMPILE_AC:
            eager, fast = sides[f"{ac} eager"], sides[f"{ac} compiled"]
            first = (eager["losses"][0], fast["losses"][0])
            if abs(first[0] - first[1]) > 1e-4 * abs(first[0]):
                raise SystemExit(f"bench_moe: {layout}, {ac} AC compiled gives loss {first[1]} against eager's "
                                 f"{first[0]}")
            report["speedup"][f"{layout} {ac}"] = eager["median_s"] / fast["median_s"]
        for name, side in sides.items():
            lines.append(f"{layout:<12}{name:<20}{side['median_s']:>12.4f}{side['graphs']:>8}"
                         f"{side['graph_breaks']:>8}")
    lines.append("compiled / eager (median): " + ", ".join(f"{name} {x:.2f}x"
                                                           for name, x in report["speedup"].items()))
    return report, lines


# The parallel part's model: Qwen3-MoE's block at a size where the experts dominate the weights (4 layers of 32
# experts of 256 -> 256, 4 per token: 25 M of the 27 M parameters), the embedded tokenizer's vocabulary.
PARALLEL_MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=32, num_experts_per_tok=4,
                      moe_intermediate_size=256, norm_topk_prob=True, max_position_embeddings=512,
                      tie_word_embeddings=False)
LAYOUTS_2 = {"FSDP2 2": 1, "EP 2": 2}  # name -> expert_parallel_dim, both on 2 processes


def _write_parallel_checkpoint(path: Path, quick: bool) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(PARALLEL_MODEL, num_hidden_layers=2, num_experts=8) if quick else PARALLEL_MODEL
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape)).save_pretrained(path)


def _parallel_run(checkpoint: Path, output_dir: Path, ep: int, steps: int, batch_size: int) -> dict[str, float]:
    command = [sys.executable, "-m", "torchtune_ac.cli", "run", "--nproc_per_node", "2", "full_finetune",
               "--config", "tiny/moe", "model._component_=torchtune_ac.models.from_hf_config",
               f"checkpoint_dir={checkpoint}", "tokenizer.path=${embedded_checkpoint:}", f"output_dir={output_dir}",
               f"max_steps_per_epoch={steps}", f"batch_size={batch_size}", "max_seq_len=256", "dataset.packed=true",
               f"expert_parallel_dim={ep}", "lr_scheduler=null"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            check=False)
    if result.returncode != 0:
        raise SystemExit(f"bench_moe: {' '.join(command)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    timed = records[2:] or records
    return {"tokens_per_second_per_process": statistics.median(r["tokens_per_second"] for r in timed) / 2,
            "peak_memory_gib": max(r["peak_memory_gib"] for r in records)}


def parallel(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """EP 2 against FSDP2 2 on the same MoE, fresh processes A B B A."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS_2}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        _write_parallel_checkpoint(checkpoint, args.quick)
        names = list(LAYOUTS_2)
        order = [name for round_index in range(args.repeats)
                 for name in (names if round_index % 2 == 0 else names[::-1])]
        for index, name in enumerate(order):
            runs[name].append(_parallel_run(checkpoint, Path(tmp) / f"run{index}", LAYOUTS_2[name], args.steps,
                                            args.batch_size))
            print(f"  {name}: {runs[name][-1]}", flush=True)
    summary = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for name, results in runs.items()}
    report = {"model": PARALLEL_MODEL if not args.quick else "quick", "steps": args.steps,
              "batch_size_per_process": args.batch_size, "runs": runs, "median": summary,
              "ep_over_fsdp_tokens_per_second": summary["EP 2"]["tokens_per_second_per_process"]
              / summary["FSDP2 2"]["tokens_per_second_per_process"],
              "ep_over_fsdp_peak_memory": summary["EP 2"]["peak_memory_gib"] / summary["FSDP2 2"]["peak_memory_gib"]}
    lines = [f"parallel: 2 processes, {args.batch_size} packed rows of 256 tokens each, {args.steps} steps, "
             f"{args.repeats} run(s) of each",
             f"{'layout':<10}{'tokens/s per process':>22}{'peak RSS GiB':>14}"]
    for name, values in summary.items():
        lines.append(f"{name:<10}{values['tokens_per_second_per_process']:>22.0f}{values['peak_memory_gib']:>14.3f}")
    lines.append(f"EP 2 / FSDP2 2: tokens/s {report['ep_over_fsdp_tokens_per_second']:.2f}x, peak memory "
                 f"{report['ep_over_fsdp_peak_memory']:.2f}x")
    return report, lines


def plot(report: dict, path: Path) -> None:
    parts = [part for part in ("kernels", "compile", "parallel") if part in report]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(parts) + ("parallel" in report), figsize=(4.2 * (len(parts) + 1), 3.4))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    if "kernels" in report:
        ax = axes.pop(0)
        seconds = report["kernels"]["seconds"]
        ax.bar(list(seconds), [seconds[name]["median"] for name in seconds], color=["#4c72b0", "#c44e52", "#8c8c8c"])
        ax.set_ylabel("seconds, forward + backward (median)")
        shape = report["kernels"]["shape"]
        ax.set_title(f"one layer's experts: {shape['experts']} x top-{shape['top_k']}", fontsize=9)
    if "compile" in report:
        ax = axes.pop(0)
        bars = {f"{layout}\n{name}": side["median_s"]
                for layout, sides in report["compile"]["layouts"].items() for name, side in sides.items()}
        ax.bar(list(bars), list(bars.values()), color=["#8c8c8c", "#4c72b0"] * (len(bars) // 2))
        ax.set_ylabel("seconds a step (median)")
        ax.tick_params(axis="x", labelsize=6, rotation=90)
        ax.set_title("qwen3_moe_tiny, eager against compiled", fontsize=9)
    if "parallel" in report:
        median = report["parallel"]["median"]
        for key, label in (("tokens_per_second_per_process", "tokens/s per process"),
                           ("peak_memory_gib", "peak resident set, GiB (rank 0)")):
            ax = axes.pop(0)
            ax.bar(list(median), [median[name][key] for name in median], color=["#8c8c8c", "#4c72b0"])
            ax.set_ylabel(label)
            ax.set_title("2 processes, the same MoE", fontsize=9)
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("kernels", "compile", "parallel"), help="run one part")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3_moe")
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--expert-dim", type=int, default=384)
    parser.add_argument("--tokens", type=int, default=512, help="tokens routed (each to top-k experts)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32 by default: a CPU without bf16 matrix units runs bf16 matmuls far slower")
    parser.add_argument("--repeats", type=int, default=3,
                        help="kernels: rounds; compile: timed steps; parallel: runs of each layout")
    parser.add_argument("--steps", type=int, default=10, help="parallel: steps of each run (2 of warm-up)")
    parser.add_argument("--batch-size", type=int, default=4, help="parallel: packed rows per process")
    parser.add_argument("--threads", type=int, default=None, help="kernels: torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, few steps: check the script runs")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "bench_moe.json")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "images" / "bench_moe.png")
    args = parser.parse_args(argv)
    if args.quick:
        args.experts, args.top_k, args.dim, args.expert_dim, args.tokens, args.repeats = 8, 2, 64, 32, 128, 2
        args.steps, args.batch_size = 3, 2
    report: dict[str, Any] = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
                              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
                              "load_average_at_start": os.getloadavg()}
    lines: list[str] = []
    for name, part in (("kernels", kernels), ("compile", compiled), ("parallel", parallel)):
        if args.only in (None, name):
            report[name], part_lines = part(args)
            lines += part_lines
    write_report(report, "\n".join(lines), args.out, plot, args.png)


if __name__ == "__main__":
    main()
