"""Benchmark activation checkpointing settings: activation memory vs. step time, on CPU.

    .venv/bin/python scripts/bench/bench_ac.py                      # llama_small, batch 4, seq 1024, fp32 (~6 min on 2 cores)
    .venv/bin/python scripts/bench/bench_ac.py --seq-len 256 --repeats 2 --settings none,full,op

For each setting (none, full, selective every k-th block, selective per-op) it measures, with a fresh model
built from the same seed and the same batch:
  * saved activations: bytes kept for backward by one training forward (model + loss), see
    ``_measure.measure_saved_activation_bytes``;
  * step time: median wall time of forward + backward + AdamW step, after a warm-up step;
  * peak RSS of the process while that setting trains (Linux VmHWM, reset before each run, after freed
    heap is handed back to the OS, so one run's peak does not include memory left from an earlier run).
Repeats are interleaved across settings, and the order rotates each round, so slow drift of the machine
(thermal, other processes) spreads over all settings instead of biasing one.

Writes a JSON file and a chart (x: step time relative to no AC, y: activation memory relative to no AC).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, write_report  # noqa: E402
from _measure import (  # noqa: E402
    measure_saved_activation_bytes,
    return_freed_memory_to_os,
    track_peak_rss,
)

from torchtune_ac import models  # noqa: E402
from torchtune_ac.activation_checkpointing import setup_activation_checkpointing  # noqa: E402

MiB = 2**20
# (max step time ratio, max activation ratio) each setting should reach; drawn on the chart.
TARGETS = {"full": (1.45, 0.20), "op": (1.15, 0.70)}


@dataclass(frozen=True)
class Setting:
    """One AC configuration, as the config keys would spell it."""

    name: str
    ac_mode: str
    ac_option: Optional[Union[int, str]]


def parse_setting(text: str) -> Setting:
    """``none`` | ``full`` | ``op`` | an integer k (selective every k-th block)."""
    text = text.strip().lower()
    if text in ("none", "full"):
        return Setting(text, text, None)
    if text == "op":
        return Setting("op", "selective", "op")
    if text.isdigit():
        return Setting(f"k={text}", "selective", int(text))
    raise argparse.ArgumentTypeError(f"unknown setting {text!r}: use none, full, op or an integer k")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama_small", help="builder name in torchtune_ac.models")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per setting (one per round)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before each timed step")
    parser.add_argument(
        "--settings", default="none,full,2,4,op", help="comma-separated: none, full, op, or an integer k"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-json", type=Path, default=REPO / "bench_results" / "bench_ac.json")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "images" / "bench_ac.png")
    args = parser.parse_args(argv)
    args.settings = [parse_setting(s) for s in args.settings.split(",")]
    if args.settings[0].name != "none":
        parser.error("--settings must start with none (the baseline the ratios are relative to)")
    builder = getattr(models, args.model, None)
    if not callable(builder):
        parser.error(f"--model {args.model!r}: no such builder in torchtune_ac.models")
    args.builder = builder
    return args


def build_model(args: argparse.Namespace, setting: Setting) -> tuple[torch.nn.Module, str]:
    """A fresh model with the seed's weights and ``setting`` applied; returns it and ``str(plan)``."""
    torch.manual_seed(args.seed)
    model = args.builder(max_seq_len=args.seq_len)
    model.init_weights()
    plan = setup_activation_checkpointing(model, ac_mode=setting.ac_mode, ac_option=setting.ac_option)
    model.train()
    return model, str(plan)


def compute_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``tokens[b, s + 1]``."""
    logits = model(tokens[:, :-1])  # [b, s, vocab]
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> float:
    """Forward, backward and optimizer step; returns the loss."""
    loss = compute_loss(model, tokens)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run_benchmark(args: argparse.Namespace) -> dict:
    """Measure every setting; returns ``{"config": ..., "results": [one dict per setting]}``."""
    with torch.device("meta"):
        vocab_size = args.builder().args.vocab_size
    tokens = torch.randint(0, vocab_size, (args.batch_size, args.seq_len + 1),
                           generator=torch.Generator().manual_seed(args.seed))
    results = {s.name: {"setting": s.name, "ac_mode": s.ac_mode, "ac_option": s.ac_option, "step_times_s": [],
                        "step_cpu_times_s": [], "peak_rss_bytes": [], "losses": []} for s in args.settings}
    heap_returned = return_freed_memory_to_os()
    load_at_start = os.getloadavg()

    for setting in args.settings:
        model, plan = build_model(args, setting)
        results[setting.name]["plan"] = plan
        results[setting.name]["saved_activation_bytes"] = measure_saved_activation_bytes(
            compute_loss, model, tokens, exclude=list(model.parameters())
        )
        del model

    n = len(args.settings)
    visits = [args.settings[(r + i) % n] for r in range(args.repeats) for i in range(n)]
    rss_method = None
    for setting in tqdm(visits, desc="bench_ac", unit="run"):
        entry = results[setting.name]
        return_freed_memory_to_os()
        with track_peak_rss() as peak:
            model, _ = build_model(args, setting)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            for _ in range(args.warmup):
                train_step(model, optimizer, tokens)
            start, start_cpu = time.perf_counter(), time.process_time()
            entry["losses"].append(train_step(model, optimizer, tokens))
            entry["step_times_s"].append(time.perf_counter() - start)
            entry["step_cpu_times_s"].append(time.process_time() - start_cpu)
            del model, optimizer
        entry["peak_rss_bytes"].append(peak.peak_bytes)
        rss_method = peak.method

    base = results["none"]
    base_bytes = base["saved_activation_bytes"]
    base_time = statistics.median(base["step_times_s"])
    base_cpu_time = statistics.median(base["step_cpu_times_s"])
    for entry in results.values():
        entry["median_step_time_s"] = statistics.median(entry["step_times_s"])
        entry["activation_ratio"] = entry["saved_activation_bytes"] / base_bytes
        entry["time_ratio"] = entry["median_step_time_s"] / base_time
        # CPU time of this process is less disturbed than wall time when other processes share the cores.
        entry["median_step_cpu_time_s"] = statistics.median(entry["step_cpu_times_s"])
        entry["cpu_time_ratio"] = entry["median_step_cpu_time_s"] / base_cpu_time
        entry["max_peak_rss_bytes"] = max(entry["peak_rss_bytes"])
    for name, (max_time, max_act) in TARGETS.items():
        if name in results:
            entry = results[name]
            entry["target"] = {"max_time_ratio": max_time, "max_activation_ratio": max_act,
                               "met": entry["time_ratio"] <= max_time and entry["activation_ratio"] <= max_act}

    return {
        "config": {
            "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": "float32",
            "repeats": args.repeats, "warmup_steps": args.warmup, "seed": args.seed, "optimizer": "AdamW",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "peak_rss_method": rss_method,
            "freed_memory_returned_to_os": heap_returned, "load_average_at_start": load_at_start,
            "load_average_at_end": os.getloadavg(),
            "saved_activations": "one training forward (model + cross-entropy), parameters excluded",
        },
        "results": list(results.values()),
    }


def format_table(report: dict) -> str:
    """The results as a fixed-width text table."""
    header = (f"{'setting':8} {'saved act MiB':>13} {'x none':>7} {'step s':>8} {'x none':>7} {'CPU s':>7} "
              f"{'x none':>7} {'peak RSS MiB':>12}  plan")
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        lines.append(
            f"{r['setting']:8} {r['saved_activation_bytes'] / MiB:13.1f} {r['activation_ratio']:7.2f} "
            f"{r['median_step_time_s']:8.2f} {r['time_ratio']:7.2f} {r['median_step_cpu_time_s']:7.2f} "
            f"{r['cpu_time_ratio']:7.2f} {r['max_peak_rss_bytes'] / MiB:12.0f}  {r['plan']}"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Save the time-ratio / memory-ratio scatter with the target boxes to ``path``."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    fig, ax = plt.subplots(figsize=(7, 5))
    colors = {"full": "tab:red", "op": "tab:green"}
    ratios = [r["time_ratio"] for r in report["results"]]
    # On CPU a checkpointed step can be faster than no AC (less memory traffic), so x may go below 1.
    x_lo, x_hi = min(0.95, min(ratios) - 0.05), max(1.6, max(ratios) + 0.1)
    for name, (max_time, max_act) in TARGETS.items():
        ax.add_patch(Rectangle((x_lo, 0.0), max_time - x_lo, max_act, fill=False, linestyle="--",
                               edgecolor=colors[name], label=f"target for {name}: <= {max_time}x time, "
                               f"<= {max_act:.0%} activations"))
    for r in report["results"]:
        ax.scatter(r["time_ratio"], r["activation_ratio"], s=50, color=colors.get(r["setting"], "tab:blue"), zorder=3)
        ax.annotate(f"{r['setting']}: {r['saved_activation_bytes'] / MiB:.0f} MiB, {r['median_step_time_s']:.2f} s",
                    (r["time_ratio"], r["activation_ratio"]), textcoords="offset points", xytext=(7, -3), fontsize=8)
    cfg = report["config"]
    ax.set_xlabel("step time relative to no AC (forward + backward + AdamW)")
    ax.set_ylabel("saved activations relative to no AC")
    ax.set_title(f"Activation checkpointing on {cfg['model']}: batch {cfg['batch_size']} x {cfg['seq_len']} "
                 f"tokens, fp32, {cfg['threads']} CPU threads", fontsize=9)
    ax.set_xlim(x_lo, x_hi)
    ax.set_ylim(0.0, 1.1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    report = run_benchmark(args)
    write_report(report, format_table(report), args.out_json, plot, args.out_png)


if __name__ == "__main__":
    main()
