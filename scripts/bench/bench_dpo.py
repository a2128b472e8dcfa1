"""Benchmark the DPO recipe on CPU: does it learn a preference it was not shown, what does a resident reference
model cost in memory, and how fast are padded and packed DPO against TRL?

    .venv/bin/python scripts/bench/bench_dpo.py                              # learning and memory
    .venv/bin/python scripts/bench/bench_dpo.py --only learning --steps 300
    .venv/bin/python scripts/bench/bench_dpo.py --only memory --repeats 2
    .venv/bin/python scripts/bench/bench_dpo.py --only speed                 # padded, packed and TRL (needs trl)

1. learning: ``tune run full_dpo --config tiny/dpo`` (the embedded 1.6 M-parameter model from its random weights)
   for ``--steps`` steps on the embedded synthetic pairs, whose chosen answer is the bare answer and whose rejected
   answer hedges it ("Maybe 7?"). Every ``--val-every`` steps it validates on the held-out pairs, which hedge in
   words the training pairs never use: the reward accuracy there (the share of held-out pairs whose chosen answer
   gets the higher reward) and the loss, from ``metrics.jsonl``'s ``val_rewards_accuracy`` and ``val_loss``.
2. memory: the same recipe on a model whose weights dominate (``llama_small``: 8 blocks of dim 512, a
   8,192-token vocabulary, fp32) with ``dpo.reference: resident`` and ``precomputed``, interleaved A/B/B/A in
   fresh processes: each run's peak resident set (``metrics.jsonl``'s ``peak_memory_gib``, the process's
   ``ru_maxrss``, set-up and the precomputing pass included), next to what ``tune plan`` plans for each.

3. speed (``--only speed``, ``_dpo_speed.py``): padded DPO, packed DPO (``dataset.packed: true``) and TRL 1.16's
   ``DPOTrainer`` on the same model (saved with ``save_hf``, loaded by both), the same token ids of the same pairs
   with UltraFeedback's length spread made from the embedded pairs, in the same order, about the same pairs a step,
   a resident reference, fp32: tokens/s over the steps after a warm-up, and the peak resident set, interleaved
   A/B/C/C/B/A in fresh processes (each ``--repeats`` adds one such round). The defaults (``llama_small``, 32 pairs,
   4 a step, ``max_seq_len`` 512, the first step of 8 not timed, half the cores' threads) are sized for about 5
   minutes on 2 quiet cores. Targets: packed >= 1.3x padded, and faster than TRL.

Writes ``bench_results/bench_dpo.json`` and ``docs/images/bench_dpo.png`` (speed: ``bench_dpo_speed.json`` and
``bench_dpo_speed.png``).
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, write_report  # noqa: E402

GiB = 2**30


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("learning", "memory", "speed"), help="run one part (speed only this way)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps of the learning run")
    parser.add_argument("--val-every", type=int, default=25, help="validate every N steps")
    parser.add_argument("--memory-steps", type=int, default=4, help="steps of each memory run")
    parser.add_argument("--repeats", type=int, default=1, help="A/B/B/A rounds of the memory runs")
    parser.add_argument("--model", default="llama_small", help="speed: the model (a torchtune_ac.models builder)")
    parser.add_argument("--pairs", type=int, default=32, help="speed: pairs of one epoch (each run trains them once)")
    parser.add_argument("--batch-size", type=int, default=4, help="speed: pairs a step")
    parser.add_argument("--warmup-steps", type=int, default=1, help="speed: first steps of each run not timed")
    parser.add_argument("--max-seq-len", type=int, default=512, help="speed: max_seq_len (TRL's max_length)")
    parser.add_argument("--length-scale", type=float, default=0.25,
                        help="speed: UltraFeedback's lengths times this (0.25: a median answer of 65 tokens)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="speed: threads")
    parser.add_argument("--seed", type=int, default=0, help="speed: the seed of the drawn lengths")
    parser.add_argument("--out-json", type=Path, help="default: bench_results/bench_dpo.json (speed: _speed.json)")
    parser.add_argument("--out-png", type=Path, help="default: docs/images/bench_dpo.png (speed: _speed.png)")
    return parser.parse_args(argv)


def tune(*argv: str) -> subprocess.CompletedProcess:
    """``tune ...`` in a fresh process of this interpreter (its own peak resident set), checked."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "torchtune_ac.cli", *argv], check=True, capture_output=True,
                          text=True, env=env, cwd=REPO)


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def run_learning(args: argparse.Namespace, root: Path) -> dict:
    out = root / "learning"
    started = time.perf_counter()
    tune("run", "full_dpo", "--config", "tiny/dpo", f"output_dir={out}", f"max_steps_per_epoch={args.steps}",
         f"run_val_every_n_steps={args.val_every}", "log_every_n_steps=1", "save_every_n_steps=null")
    seconds = time.perf_counter() - started
    records = read_metrics(out)
    validations = [{"step": r["step"], "rewards_accuracy": r["val_rewards_accuracy"], "loss": r["val_loss"]}
                   for r in records if "val_loss" in r]
    return {"steps": args.steps, "seconds": seconds, "validations": validations,
            "train": [{"step": r["step"], "loss": r["loss"], "rewards_accuracy": r["rewards_accuracy"]}
                      for r in records]}


def memory_overrides() -> tuple[str, ...]:
    """llama_small from the seed (its weights the largest part of the process), the embedded tokenizer and pairs."""
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR

    return ("model._component_=torchtune_ac.models.llama_small", "checkpoint_dir=null",
            f"tokenizer.path={EMBEDDED_TOKENIZER_DIR}", "batch_size=4", "max_seq_len=128",
            "enable_activation_checkpointing=false", "dataset_val=null", "run_val_every_n_steps=null")


def planned(reference: str) -> dict:
    """``tune plan``'s row for no AC: its reference part, the step's tensors and the device total, in GiB."""
    lines = tune("plan", "--config", "tiny/dpo", *memory_overrides(), f"dpo.reference={reference}").stdout.splitlines()
    header = next(line for line in lines if line.startswith("setting")).split()
    row = next(line for line in lines if line.startswith("none ")).split()
    values = dict(zip(header, row))
    unit = 1 / 1024 if any("MiB" in line for line in lines[:2]) else 1.0
    return {name: float(values.get(name, 0.0)) * unit for name in ("parameters", "reference", "step", "device")}


def run_memory(args: argparse.Namespace, root: Path) -> dict:
    order = ["resident", "precomputed", "precomputed", "resident"] * args.repeats
    peaks: dict[str, list[float]] = {"resident": [], "precomputed": []}
    for index, reference in enumerate(order):
        out = root / f"memory_{index}_{reference}"
        tune("run", "full_dpo", "--config", "tiny/dpo", f"output_dir={out}", *memory_overrides(),
             f"max_steps_per_epoch={args.memory_steps}", f"dpo.reference={reference}", "save_every_n_steps=null")
        peaks[reference].append(max(r["peak_memory_gib"] for r in read_metrics(out)))
    return {"model": "llama_small (fp32)", "steps": args.memory_steps, "peak_gib": peaks,
            "planned_gib": {reference: planned(reference) for reference in peaks}}


def machine() -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "platform": platform.platform()}


def format_table(report: dict) -> str:
    lines = []
    if "learning" in report:
        lines.append("step  held-out rewards_accuracy  held-out loss")
        for v in report["learning"]["validations"]:
            lines.append(f"{v['step']:>4}  {v['rewards_accuracy']:>25.3f}  {v['loss']:>13.4f}")
    if "memory" in report:
        memory = report["memory"]
        for reference, peaks in memory["peak_gib"].items():
            plan = memory["planned_gib"][reference]
            lines.append(f"{reference:>11}: peak resident set {' / '.join(f'{p:.3f}' for p in peaks)} GiB measured; "
                         f"planned {plan['device']:.3f} GiB (reference {plan['reference']:.3f}, step "
                         f"{plan['step']:.3f})")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2 if "memory" in report else 1, figsize=(10, 4), squeeze=False)
    if "learning" in report:
        validations = report["learning"]["validations"]
        ax = axes[0][0]
        ax.plot([v["step"] for v in validations], [v["rewards_accuracy"] for v in validations], marker="o")
        ax.axhline(0.5, color="grey", linestyle=":")
        ax.set(xlabel="step", ylabel="held-out reward accuracy", ylim=(0, 1.05), title="tiny/dpo on CPU")
    if "memory" in report:
        memory = report["memory"]
        ax = axes[0][-1]
        names = list(memory["peak_gib"])
        ax.bar(names, [max(memory["peak_gib"][n]) for n in names], label="measured peak")
        ax.scatter(names, [memory["planned_gib"][n]["device"] for n in names], color="black", zorder=3,
                   label="planned (device)")
        ax.set(ylabel="GiB", title=f"{memory['model']}: the reference's cost")
        ax.legend()
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    suffix = "_speed" if args.only == "speed" else ""
    args.out_json = args.out_json or REPO / "bench_results" / f"bench_dpo{suffix}.json"
    args.out_png = args.out_png or REPO / "docs" / "images" / f"bench_dpo{suffix}.png"
    if args.only == "speed":
        from _dpo_speed import format_speed, plot_speed, run_speed

        with tempfile.TemporaryDirectory(prefix="bench_dpo_speed-") as root:
            report = {"machine": machine(), "speed": run_speed(args, Path(root))}
        report["machine"]["load_average_after"] = os.getloadavg()
        write_report(report, format_speed(report["speed"]), args.out_json,
                     lambda r, path: plot_speed(r["speed"], path), args.out_png)
        return
    report = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="bench_dpo-") as root:
        if args.only in (None, "learning"):
            report["learning"] = run_learning(args, Path(root))
        if args.only in (None, "memory"):
            report["memory"] = run_memory(args, Path(root))
    report["machine"]["load_average_after"] = os.getloadavg()
    write_report(report, format_table(report), args.out_json, plot, args.out_png)


if __name__ == "__main__":
    main()
