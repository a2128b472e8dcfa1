"""Benchmark the memory switches: peak memory and step time of {ordinary step, optimizer in backward} x
{whole logits, chunked loss} x {no AC, full AC}, on CPU, through the recipe's own training path.

    .venv/bin/python scripts/bench_memory.py                 # llama_small_32k, batch 4 x 1024, fp32 (~10 min)
    .venv/bin/python scripts/bench_memory.py --seq-len 256 --repeats 1      # a quick look

For every setting and round, a fresh model (same seed) and AdamW run one warm-up step (which allocates the
optimizer state), then one measured step of ``train_step`` (forward, loss, backward, optimizer step), with:
  * peak memory: the process's resident-memory high-water mark during the step (Linux VmHWM, reset at the
    start of the step, after freed heap is handed back to the OS) minus its resident memory just before it:
    what the step needs above the model, its optimizer state and the batch;
  * step time: wall time of that step.
Rounds are interleaved across settings and the order rotates each round, so drift of the machine spreads over
all settings. Time ratios compare each setting with the ordinary step on the whole logits at the same AC mode.

Writes a JSON file and a chart, and prints the table and whether each target is met:
  * the chunked loss lowers the peak by at least 70 % of the fp32 logits' bytes, in every AC mode, at <= 1.05x;
  * with full AC and the chunked loss, the optimizer step in backward lowers the peak by at least 80 % of the
    gradients' bytes, at <= 1.05x.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, write_report  # noqa: E402
from _measure import return_freed_memory_to_os, track_peak_rss  # noqa: E402

from torchtune_ac.config.components import Component  # noqa: E402
from torchtune_ac.config.meta_model import build_meta_model  # noqa: E402
from torchtune_ac.memory.activation_checkpointing import ACConfig, ACMode  # noqa: E402
from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan  # noqa: E402
from torchtune_ac.run.model_setup import build_training_model  # noqa: E402
from torchtune_ac.runtime.distributed import DistributedContext, FSDPConfig  # noqa: E402
from torchtune_ac.runtime.dtypes import DType  # noqa: E402
from torchtune_ac.training.objective import IGNORE_INDEX  # noqa: E402
from torchtune_ac.training.step import train_step  # noqa: E402

MiB = 2**20
CHUNKS = 8
CHUNK_TARGET = (0.70, 1.05)  # (share of the logits' bytes saved, max step time ratio)
IN_BACKWARD_TARGET = (0.80, 1.05)  # (share of the gradients' bytes saved, max step time ratio)


@dataclass(frozen=True)
class Setting:
    ac: str  # none | full
    chunked: bool
    in_backward: bool

    @property
    def name(self) -> str:
        loss = f"chunked x{CHUNKS}" if self.chunked else "whole logits"
        step = "optimizer in backward" if self.in_backward else "ordinary step"
        return f"AC {self.ac}, {loss}, {step}"

    @property
    def reference(self) -> "Setting":
        return Setting(self.ac, chunked=False, in_backward=False)


SETTINGS = [Setting(ac, chunked, in_backward) for ac in ("none", "full") for chunked in (False, True)
            for in_backward in (False, True)]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama_small_32k", help="builder name in torchtune_ac.models")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="measured steps per setting (one per round)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-json", type=Path, default=REPO / "bench_results" / "bench_memory.json")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "images" / "bench_memory.png")
    return parser.parse_args(argv)


def make_batch(args: argparse.Namespace, vocab_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, vocab_size, (args.batch_size, args.seq_len), generator=generator)
    labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], IGNORE_INDEX)], dim=1)
    return {"tokens": tokens, "labels": labels}


def measure(args: argparse.Namespace, setting: Setting, batch: dict[str, torch.Tensor]) -> tuple[int, float]:
    """Peak bytes above the pre-step resident memory, and wall seconds, of one step after a warm-up step."""
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    component = Component(key="model", path=f"torchtune_ac.models.{args.model}")
    memory = MemoryConfig(optimizer_in_bwd=setting.in_backward, loss_chunks=CHUNKS if setting.chunked else 1)
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode(setting.ac)), memory, build_meta_model(component),
                               clip_grad_norm=None)
    model = build_training_model(component, ctx=ctx, dtype=DType.FP32, memory=plan, fsdp=FSDPConfig(),
                                 compile_blocks=False, checkpoint_dir=None, seed=args.seed)
    optimizer = plan.build_stepper(lambda params: torch.optim.AdamW(params, lr=1e-5), model)
    train_step(model, optimizer, [batch], ctx=ctx, objective=plan.objective())  # allocates the optimizer state
    return_freed_memory_to_os()
    before = psutil.Process().memory_info().rss
    with track_peak_rss() as peak:
        start = time.perf_counter()
        train_step(model, optimizer, [batch], ctx=ctx, objective=plan.objective())
        seconds = time.perf_counter() - start
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()
    del model, optimizer
    gc.collect()
    return_freed_memory_to_os()
    return peak.peak_bytes - before, seconds


def run_benchmark(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        reference = build_meta_model(Component(key="model", path=f"torchtune_ac.models.{args.model}"))
    vocab_size = reference.args.vocab_size
    n_params = sum(p.numel() for p in reference.parameters())
    batch = make_batch(args, vocab_size)
    peaks: dict[str, list[int]] = {s.name: [] for s in SETTINGS}
    times: dict[str, list[float]] = {s.name: [] for s in SETTINGS}
    progress = tqdm(total=args.repeats * len(SETTINGS), desc="bench_memory", file=sys.stderr)
    for round_ in range(args.repeats):
        shift = round_ % len(SETTINGS)
        for setting in SETTINGS[shift:] + SETTINGS[:shift]:
            peak, seconds = measure(args, setting, batch)
            peaks[setting.name].append(peak)
            times[setting.name].append(seconds)
            progress.update(1)
    progress.close()

    logits_bytes = args.batch_size * args.seq_len * vocab_size * 4
    grad_bytes = n_params * 4
    rows = []
    for setting in SETTINGS:
        ref = setting.reference.name
        rows.append({
            "setting": setting.name, "ac": setting.ac, "chunked": setting.chunked, "in_backward": setting.in_backward,
            "peak_mib": statistics.median(peaks[setting.name]) / MiB,
            "peak_mib_all": [p / MiB for p in peaks[setting.name]],
            "step_s": statistics.median(times[setting.name]),
            "step_s_all": times[setting.name],
            # Ratio of the medians of the per-round ratios (each round's pair ran close together in time).
            "time_ratio": statistics.median(t / r for t, r in zip(times[setting.name], times[ref])),
        })
    by_name = {row["setting"]: row for row in rows}
    targets = []
    for ac in ("none", "full"):
        whole, chunked = by_name[Setting(ac, False, False).name], by_name[Setting(ac, True, False).name]
        saved = (whole["peak_mib"] - chunked["peak_mib"]) * MiB
        targets.append({
            "target": f"chunked loss, AC {ac}: saves >= {CHUNK_TARGET[0]:.0%} of the logits at <= {CHUNK_TARGET[1]}x",
            "saved_mib": saved / MiB, "share": saved / logits_bytes, "time_ratio": chunked["time_ratio"],
            "met": saved >= CHUNK_TARGET[0] * logits_bytes and chunked["time_ratio"] <= CHUNK_TARGET[1],
        })
    base, in_bwd = by_name[Setting("full", True, False).name], by_name[Setting("full", True, True).name]
    saved = (base["peak_mib"] - in_bwd["peak_mib"]) * MiB
    ratio = statistics.median(
        t / r for t, r in zip(times[in_bwd["setting"]], times[base["setting"]]))
    targets.append({
        "target": (f"optimizer in backward, full AC + chunked: saves >= {IN_BACKWARD_TARGET[0]:.0%} of the gradients "
                   f"at <= {IN_BACKWARD_TARGET[1]}x"),
        "saved_mib": saved / MiB, "share": saved / grad_bytes, "time_ratio": ratio,
        "met": saved >= IN_BACKWARD_TARGET[0] * grad_bytes and ratio <= IN_BACKWARD_TARGET[1],
    })
    return {
        "model": args.model, "parameters": n_params, "vocab_size": vocab_size, "batch_size": args.batch_size,
        "seq_len": args.seq_len, "repeats": args.repeats, "chunks": CHUNKS, "dtype": "fp32",
        "logits_mib": logits_bytes / MiB, "gradients_mib": grad_bytes / MiB,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "rows": rows, "targets": targets,
    }


def format_table(report: dict) -> str:
    lines = [f"{report['model']} ({report['parameters']:,} parameters, vocabulary {report['vocab_size']:,}), batch "
             f"{report['batch_size']} x {report['seq_len']}, fp32: logits {report['logits_mib']:.0f} MiB, gradients "
             f"{report['gradients_mib']:.0f} MiB; medians of {report['repeats']} interleaved rounds",
             f"{'setting':<52} {'peak MiB':>9} {'step s':>7} {'time vs whole/ordinary':>23}"]
    for row in report["rows"]:
        lines.append(f"{row['setting']:<52} {row['peak_mib']:>9.0f} {row['step_s']:>7.2f} {row['time_ratio']:>23.3f}")
    for target in report["targets"]:
        lines.append(f"{'MET' if target['met'] else 'MISSED':<6} {target['target']}: saved {target['saved_mib']:.0f} MiB "
                     f"({target['share']:.0%}), {target['time_ratio']:.3f}x")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()

    groups = [(ac, chunked) for ac in ("none", "full") for chunked in (False, True)]
    rows = {(r["ac"], r["chunked"], r["in_backward"]): r for r in report["rows"]}
    fig, ax = plt.subplots(figsize=(8.5, 4.8))
    width = 0.38
    for offset, in_backward, label, color in ((-width / 2, False, "ordinary step", "tab:blue"),
                                                (width / 2, True, "optimizer in backward", "tab:green")):
        xs, heights = [], []
        for i, (ac, chunked) in enumerate(groups):
            row = rows[(ac, chunked, in_backward)]
            xs.append(i + offset)
            heights.append(row["peak_mib"])
            ax.annotate(f"{row['time_ratio']:.2f}x", (i + offset, row["peak_mib"]), ha="center", va="bottom",
                        fontsize=8)
        ax.bar(xs, heights, width, label=label, color=color)
    ax.axhline(report["logits_mib"], color="tab:red", linestyle=":", label=f"fp32 logits ({report['logits_mib']:.0f} MiB)")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"AC {ac}\n{'chunked loss' if chunked else 'whole logits'}" for ac, chunked in groups])
    ax.set_ylabel("peak memory of one step above its start (MiB)")
    ax.set_title(f"{report['model']}, batch {report['batch_size']} x {report['seq_len']}, fp32 "
                 "(labels: step time vs whole logits + ordinary step)", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    report = run_benchmark(args)
    write_report(report, format_table(report), args.out_json, plot, args.out_png)


if __name__ == "__main__":
    main()
