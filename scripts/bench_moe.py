"""Benchmark the experts' compute of one MoE layer: all experts in one grouped matmul per projection
(``torchtune_ac.models.moe.compute_experts``: ``torch._grouped_mm`` on the CPU) against a Python loop over the
experts, one matmul each (``loop_experts``), forward + backward, on CPU.

    .venv/bin/python scripts/bench_moe.py                    # Qwen3-30B-A3B's expert shape, 128 experts, 8 per token
                                                             # (fp32: a few minutes on a quiet CPU)
    .venv/bin/python scripts/bench_moe.py --quick            # a tiny shape, to check the script runs
    .venv/bin/python scripts/bench_moe.py --layout gpt_oss --experts 32 --top-k 4 --dim 2880 --expert-dim 2880

Both sides get the same weights and the same tokens, routed by the same random router, and must give the same
outputs and gradients (checked before timing; the grouped path is compared within the rounding of one expert's
reductions). Each round runs both sides in an order that rotates, so that drift of a shared machine lands on
both alike; the median and the fastest run of each are reported, with the grouped path's speed-up. Also timed:
the padded batched-matmul fallback (``grouped_mm``'s path where ``torch._grouped_mm`` does not run).

Writes ``bench_results/bench_moe.json``. Timings on a busy machine are noise: take them on a quiet one.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _benchlib import write_report  # noqa: E402

from torchtune_ac.models import moe  # noqa: E402

LAYOUTS = {
    "qwen3_moe": moe.ExpertLayout(),
    "gpt_oss": moe.ExpertLayout(in_out=True, interleaved=True, bias=True, activation="clamped_swiglu"),
}


def _padded(experts: moe.GroupedExperts, rows: torch.Tensor, plan: moe.Dispatch) -> torch.Tensor:
    """``compute_experts`` through the padded bmm fallback (what runs where ``torch._grouped_mm`` does not)."""
    original = moe.grouped_mm_runs
    moe.grouped_mm_runs = lambda x, weight: False
    try:
        return moe.compute_experts(experts, rows, plan)
    finally:
        moe.grouped_mm_runs = original


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="qwen3_moe")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--expert-dim", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens routed (each to top-k experts)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                        help="fp32 by default: a CPU without bf16 matrix units runs bf16 matmuls far slower")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and 2 repeats: check the script runs")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "bench_moe.json")
    args = parser.parse_args()
    if args.quick:
        args.experts, args.top_k, args.dim, args.expert_dim, args.tokens, args.repeats = 8, 2, 64, 32, 128, 2
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
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or
        platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "shape": {k: getattr(args, k) for k in ("layout", "experts", "top_k", "dim", "expert_dim", "tokens", "dtype")},
        "grouped_mm_runs": moe.grouped_mm_runs(rows, experts._in_out(experts.gate_up_proj)),
        "same_numbers": equal,
        "seconds": {name: {"median": median[name], "fastest": min(times[name]), "all": times[name]} for name in times},
        "grouped_speedup_vs_loop": median["loop"] / median["grouped"],
    }
    lines = [f"{args.layout}: {args.tokens} tokens x top-{args.top_k} of {args.experts} experts "
             f"({args.dim} -> {args.expert_dim}), {args.dtype}, forward + backward, {report['threads']} threads",
             f"{'side':<12}{'median s':>12}{'fastest s':>12}{'outputs equal':>16}{'max grad diff':>16}"]
    for name in SIDES:
        lines.append(f"{name:<12}{median[name]:>12.4f}{min(times[name]):>12.4f}{str(equal[name]['outputs_equal']):>16}"
                     f"{equal[name]['max_grad_difference']:>16.3g}")
    lines.append(f"grouped is {report['grouped_speedup_vs_loop']:.2f}x the loop's speed (median)")
    write_report(report, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
