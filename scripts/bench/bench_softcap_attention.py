"""Benchmark soft-capped attention (Gemma 2) against SDPA on the same shapes, one layer, forward + backward.

    .venv/bin/python scripts/bench/bench_softcap_attention.py                        # CUDA if present, else CPU
    .venv/bin/python scripts/bench/bench_softcap_attention.py --device cpu --seq-lens 256 --repeats 2   # a quick check

Sides, each ``torchtune_ac.models.attention.causal_attention`` on the same q, k, v (Gemma 2 2B's heads by default:
8 query heads, 4 K/V heads, head dim 256, scale 256 ** -0.5):

* ``sdpa``: no cap: the SDPA / Flash Attention call every uncapped model takes (the cost to compare against);
* ``softcap``: scores capped at ``--softcap`` (50, as published): the path the model takes on this device
  (FlexAttention, compiled, on CUDA; the explicit scores on a CPU);
* ``explicit`` (CUDA only): the explicit-scores path forced, the fallback CUDA takes with attention dropout.

for each row length, global (causal) and sliding-window layers (``--windows``), and whole or packed rows
(``--documents`` per row). Every side runs once per round, in an order that rotates from round to round, so that
drift of a shared machine lands on each alike; the first round is not timed (FlexAttention compiles there).

Reported per case and side: median and fastest time, the bytes saved for backward (``saved_tensors_hooks``, on any
device), CUDA's peak allocated memory above the inputs, and the ratios to ``sdpa``. On CUDA, ``softcap`` and
``explicit`` compute the same values: their largest difference is reported (a check, not a timing). There is no
pass/fail target: the numbers say what the cap costs.

Writes ``bench_results/bench_softcap_attention.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import write_report  # noqa: E402

from torchtune_ac.models.attention import (  # noqa: E402
    _per_document_attention,
    _explicit_attention,
    causal_attention,
    document_runs,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on a CPU")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-lens", default=None, help="comma-separated row lengths (default: 2048,8192 on "
                                                        "CUDA, 512,1024 on a CPU)")
    parser.add_argument("--windows", default="none,4096",
                        help="comma-separated: none (a global layer) or W (a sliding layer of W tokens)")
    parser.add_argument("--documents", default="1,4", help="comma-separated documents per row (1: unpacked)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--softcap", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (after one untimed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-json", type=Path, default=REPO / "bench_results" / "bench_softcap_attention.json")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    try:
        args.seq_lens = [int(x) for x in (args.seq_lens or ("2048,8192" if args.device == "cuda" else "512,1024"))
                         .split(",")]
        args.windows = [None if x.strip() == "none" else int(x) for x in args.windows.split(",")]
        args.documents = [int(x) for x in args.documents.split(",")]
    except ValueError:
        parser.error("--seq-lens, --documents take integers; --windows integers or none")
    for name in ("batch_size", "heads", "kv_heads", "head_dim", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads={args.heads} must be a multiple of --kv-heads={args.kv_heads}")
    if any(n < 1 for n in args.documents) or any(w is not None and w < 1 for w in args.windows):
        parser.error("--documents and --windows must be positive")
    if any(s < max(args.documents) for s in args.seq_lens):
        parser.error("every --seq-lens value must be at least the largest --documents")
    if not args.softcap > 0:
        parser.error(f"--softcap={args.softcap}: must be positive")
    return args


def sides(device: str) -> tuple[str, ...]:
    return ("sdpa", "softcap", "explicit") if device == "cuda" else ("sdpa", "softcap")


def make_case(args: argparse.Namespace, seq_len: int, window: Optional[int], n_documents: int) -> dict:
    """Inputs and each side's forward for one case; q, k, v laid out as the model's projections make them."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    generator = torch.Generator().manual_seed(args.seed + seq_len + n_documents)
    b, hd = args.batch_size, args.head_dim
    q, k, v = (torch.randn(b, seq_len, heads, hd, generator=generator).to(device, dtype).transpose(1, 2)
               for heads in (args.heads, args.kv_heads, args.kv_heads))
    grad_out = torch.randn(b, seq_len, args.heads, hd, generator=generator).to(device, dtype)
    runs = None
    if n_documents > 1:  # about equal documents, the last taking the remainder
        base = seq_len // n_documents
        lengths = [base] * (n_documents - 1) + [seq_len - base * (n_documents - 1)]
        ids = torch.repeat_interleave(torch.arange(n_documents), torch.tensor(lengths)).expand(b, seq_len)
        runs = document_runs(ids.to(device), torch.tensor(lengths * b))
    options = dict(scale=args.head_dim**-0.5, window=window)
    gqa = args.heads != args.kv_heads

    def explicit(q, k, v):
        if runs is None:
            out = _explicit_attention(q, k, v, dropout_p=0.0, gqa=gqa, softcap=args.softcap, **options)
            return out.transpose(1, 2)
        return _per_document_attention(q, k, v, runs=runs, dropout_p=0.0, gqa=gqa, softcap=args.softcap, **options)

    forwards: dict[str, Callable[..., torch.Tensor]] = {
        "sdpa": lambda q, k, v: causal_attention(q, k, v, dropout_p=0.0, runs=runs, **options),
        "softcap": lambda q, k, v: causal_attention(q, k, v, dropout_p=0.0, runs=runs, softcap=args.softcap,
                                                    **options),
        "explicit": explicit,
    }
    return {"inputs": (q, k, v), "grad_out": grad_out, "forwards": forwards}


def run_side(case: dict, side: str, device: str) -> dict:
    """One forward + backward: its time, the bytes saved for backward, CUDA's peak above the inputs, the output."""
    leaves = [x.detach().requires_grad_() for x in case["inputs"]]
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = case["forwards"][side](*leaves)
    out.backward(case["grad_out"])
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else None
    input_bytes = sum(x.untyped_storage().nbytes() for x in case["inputs"])
    return {"time_s": elapsed, "saved_bytes": sum(saved.values()), "saved_bytes_beyond_inputs":
            sum(saved.values()) - input_bytes, "peak_bytes": peak, "out": out.detach()}


def run_benchmark(args: argparse.Namespace) -> dict:
    names = sides(args.device)
    cases = [(s, w, n) for s in args.seq_lens for w in args.windows for n in args.documents]
    built = {case: make_case(args, *case) for case in cases}
    results = {case: {side: [] for side in names} for case in cases}
    load_at_start = os.getloadavg()
    for r in range(args.repeats + 1):
        for i, case in enumerate(cases):
            shift = (r + i) % len(names)
            for side in names[shift:] + names[:shift]:
                measured = run_side(built[case], side, args.device)
                if r == 0:
                    built[case].setdefault("outputs", {})[side] = measured.pop("out")
                else:
                    measured.pop("out")
                    results[case][side].append(measured)
        print(f"round {r + 1}/{args.repeats + 1} done", file=sys.stderr)
    entries = []
    for case in cases:
        seq_len, window, n_documents = case
        entry: dict = {"seq_len": seq_len, "window": window, "documents_per_row": n_documents}
        for side in names:
            times = [m["time_s"] for m in results[case][side]]
            first = results[case][side][0]
            entry[side] = {"times_s": times, "median_s": statistics.median(times), "min_s": min(times),
                           "saved_bytes": first["saved_bytes"],
                           "saved_bytes_beyond_inputs": first["saved_bytes_beyond_inputs"],
                           "peak_bytes": max((m["peak_bytes"] for m in results[case][side]), default=None)
                           if args.device == "cuda" else None}
        for side in names[1:]:
            entry[f"time_ratio_{side}_vs_sdpa"] = entry[side]["median_s"] / entry["sdpa"]["median_s"]
            entry[f"fastest_ratio_{side}_vs_sdpa"] = entry[side]["min_s"] / entry["sdpa"]["min_s"]
        if "explicit" in names:
            outputs = built[case]["outputs"]
            entry["max_abs_difference_softcap_vs_explicit"] = float(
                (outputs["softcap"].float() - outputs["explicit"].float()).abs().max())
        entries.append(entry)
    softcap_path = "FlexAttention (compiled)" if args.device == "cuda" else "explicit scores"
    return {
        "config": {"device": args.device, "dtype": args.dtype, "batch_size": args.batch_size, "heads": args.heads,
                   "kv_heads": args.kv_heads, "head_dim": args.head_dim, "softcap": args.softcap,
                   "repeats": args.repeats, "softcap_path": softcap_path, "seed": args.seed,
                   "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                   "machine": platform.machine(),
                   "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
                   "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
        "cases": entries,
    }


def format_table(report: dict) -> str:
    names = ["sdpa", "softcap"] + (["explicit"] if report["config"]["device"] == "cuda" else [])
    mib = 2**20
    header = f"{'row':>6} {'window':>6} {'docs':>4}"
    for side in names:
        header += f" {side + ' ms':>12} {side + ' saved MiB':>17}"
        if report["config"]["device"] == "cuda":
            header += f" {side + ' peak MiB':>16}"
    header += "".join(f" {side + '/sdpa':>13}" for side in names[1:])
    lines = [f"soft-capped path on {report['config']['device']}: {report['config']['softcap_path']}", header,
             "-" * len(header)]
    for e in report["cases"]:
        line = f"{e['seq_len']:6d} {str(e['window'] or '-'):>6} {e['documents_per_row']:4d}"
        for side in names:
            line += f" {e[side]['median_s'] * 1e3:12.2f} {e[side]['saved_bytes'] / mib:17.1f}"
            if report["config"]["device"] == "cuda":
                line += f" {e[side]['peak_bytes'] / mib:16.1f}"
        line += "".join(f" {e[f'time_ratio_{side}_vs_sdpa']:12.2f}x" for side in names[1:])
        if "max_abs_difference_softcap_vs_explicit" in e:
            line += f"  |softcap - explicit| {e['max_abs_difference_softcap_vs_explicit']:.1e}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    report = run_benchmark(args)
    write_report(report, format_table(report), args.out_json)


if __name__ == "__main__":
    main()
