"""The CPU thread settings side by side, on a quiet machine and beside busy processes: the time of
``tune run full_finetune --config tiny/full max_steps_per_epoch=20``.

    .venv/bin/python scripts/bench_cpu_threads.py            # 3 rounds, quiet and beside 4 busy processes
    .venv/bin/python scripts/bench_cpu_threads.py --quick    # 1 round of 2-step runs beside 2: checks the script
    .venv/bin/python scripts/bench_cpu_threads.py --nproc 2  # tune run --nproc_per_node 2

Three settings, each a real ``tune run`` process:

  * ``before``: what a run took before tune chose its threads: torch's default threads (one per physical core, read
    from a fresh process) and libgomp's default spin (``GOMP_SPINCOUNT=300000``, its documented value when
    ``OMP_WAIT_POLICY`` is unset), both set, so that tune leaves them as they are;
  * ``default``: none of ``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` set: tune decides
    (``torchtune_ac/runtime/cpu_threads.py``);
  * ``one thread``: ``OMP_NUM_THREADS=1``.

Three conditions: ``quiet`` (nothing else started), ``burst`` (quiet, but ``--busy`` N processes spin for the first
``BURST_S`` seconds of each run, as it looks at the machine: another process starting; issue 51), and ``busy``
(``--busy`` N Python processes spinning on the CPU, started by this script before the runs of that condition and
stopped after them). Each round takes every condition, and in each the three settings, one run after the other in an order that turns by one each round,
so that drift falls on all of them alike. An untimed run first fills the caches (the embedded checkpoint, the
file system).

A run's time is the sum of its steps' ``step_time_s`` (``metrics.jsonl``: the training, not the start-up);
its wall time, start to exit, is recorded beside it. The report gives the median of each setting and condition,
and the targets of issue 44: quiet, ``default`` within 5 % of ``before``; busy, ``default`` within 1.25x of
``one thread`` and at least 2.5x faster than ``before``; and issue 51's: after a burst, ``default`` within 5 % of
``before`` as on a quiet machine (the threads each run took are in the JSON: after a burst, every core). It writes ``bench_results/bench_cpu_threads.json`` and a
chart, ``docs/images/bench_cpu_threads.png`` (one dot per run, bars at the medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, write_report  # noqa: E402

from torchtune_ac.runtime.cpu_threads import DECIDED_VAR, THREAD_VARS  # noqa: E402

SETTINGS = ("before", "default", "one thread")
CONDITIONS = ("quiet", "burst", "busy")
# How long the burst spins from a run's start: over the start-up and the first of its looks at the machine
# (cpu_threads.LOOKS of SAMPLE_S), fewer than half of them.
BURST_S = 0.2
LIBGOMP_DEFAULT_SPIN = "300000"
RUN_TIMEOUT_S = 1800
# Issue 44's targets on this workload.
QUIET_WITHIN = 1.05  # default / before, at most
BUSY_WITHIN_ONE_THREAD = 1.25  # default / one thread, at most
BUSY_FASTER_THAN_BEFORE = 2.5  # before / default, at least
OUT_JSON = REPO / "bench_results" / "bench_cpu_threads.json"
OUT_PNG = REPO / "docs" / "images" / "bench_cpu_threads.png"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="rounds of both conditions (default 3; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="max_steps_per_epoch of each run (default 20)")
    parser.add_argument("--busy", type=int, default=None, help="busy processes beside the runs (default 4)")
    parser.add_argument("--nproc", type=int, default=1, help="processes of each run (tune run --nproc_per_node)")
    parser.add_argument("--quick", action="store_true", help="1 round of 2-step runs beside 2 busy processes")
    parser.add_argument("--out-json", type=Path, default=OUT_JSON)
    parser.add_argument("--out-png", type=Path, default=OUT_PNG)
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (2 if args.quick else 20)
    args.busy = args.busy if args.busy is not None else (2 if args.quick else 4)
    for name in ("rounds", "steps", "nproc"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)}: must be at least 1")
    if args.busy < 1:
        parser.error(f"--busy={args.busy}: must be at least 1")
    return args


def clean_environment() -> dict[str, str]:
    """This process's environment without any thread setting (the user's or tune's)."""
    return {name: value for name, value in os.environ.items() if name not in (*THREAD_VARS, DECIDED_VAR)}


def torch_default_threads() -> int:
    """torch's intra-op threads in a fresh process with no thread setting."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=clean_environment(), capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def setting_environments(before_threads: int) -> dict[str, dict[str, str]]:
    base = clean_environment()
    return {
        "before": {**base, "OMP_NUM_THREADS": str(before_threads), "GOMP_SPINCOUNT": LIBGOMP_DEFAULT_SPIN},
        "default": base,
        "one thread": {**base, "OMP_NUM_THREADS": "1"},
    }


def run_once(env: dict[str, str], output_dir: Path, steps: int, nproc: int, burst: int = 0) -> dict:
    """One ``tune run`` of tiny/full (``burst`` processes spinning for its first ``BURST_S`` seconds); its steps'
    time, wall time, and the thread line of its log."""
    launch = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    command = [sys.executable, "-m", "torchtune_ac.cli", "run", *launch, "full_finetune", "--config", "tiny/full",
               f"max_steps_per_epoch={steps}", f"output_dir={output_dir}"]
    load = os.getloadavg()[0]
    spinning = [subprocess.Popen([sys.executable, "-c", f"import time\nend = time.time() + {BURST_S}\n"
                                  "while time.time() < end: pass"]) for _ in range(burst)]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    stop_busy(spinning)
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"bench_cpu_threads: {' '.join(command)} failed ({result.returncode}):\n"
                         + result.stderr[-3000:])
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step_times = [record["step_time_s"] for record in records if "step_time_s" in record]
    threads = next((line.split("CPU threads: ", 1)[1] for line in (result.stdout + result.stderr).splitlines()
                    if "CPU threads: " in line), "")
    return {"steps_s": sum(step_times), "steps": len(step_times), "wall_s": wall, "load_before": load,
            "threads": threads}


def start_busy(count: int) -> list[subprocess.Popen]:
    """``count`` processes that keep one core each busy until stopped."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    time.sleep(1.0)  # let them take the cores before a run looks
    return busy


def stop_busy(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        process.wait()


def measure(args: argparse.Namespace) -> dict:
    before_threads = torch_default_threads()
    environments = setting_environments(before_threads)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_cpu_threads_") as tmp:
        folder = Path(tmp)
        run_once(environments["default"], folder / "warmup", args.steps, args.nproc)
        for round_index in range(args.rounds):
            for condition in CONDITIONS:
                order = SETTINGS[round_index % 3:] + SETTINGS[:round_index % 3]  # the settings, not conditions
                busy = start_busy(args.busy) if condition == "busy" else []
                try:
                    for setting in order:
                        output = folder / f"r{round_index}_{condition}_{setting.replace(' ', '_')}"
                        run = run_once(environments[setting], output, args.steps, args.nproc,
                                       burst=args.busy if condition == "burst" else 0)
                        runs.append({"round": round_index, "condition": condition, "setting": setting, **run})
                        print(f"round {round_index} {condition:>5} {setting:>10}: {run['steps_s']:7.2f} s steps, "
                              f"{run['wall_s']:7.2f} s wall, load {run['load_before']:.1f}  [{run['threads']}]",
                              flush=True)
                finally:
                    stop_busy(busy)
    return {"runs": runs, "before_threads": before_threads}


def summarise(runs: list[dict]) -> dict:
    """Median steps and wall time per condition and setting, and the targets' ratios (on the steps' time)."""
    medians: dict[str, dict[str, dict[str, float]]] = {}
    for condition in CONDITIONS:
        medians[condition] = {}
        for setting in SETTINGS:
            own = [run for run in runs if run["condition"] == condition and run["setting"] == setting]
            medians[condition][setting] = {key: statistics.median(run[key] for run in own)
                                           for key in ("steps_s", "wall_s")}
    steps = {c: {s: medians[c][s]["steps_s"] for s in SETTINGS} for c in CONDITIONS}
    quiet = steps["quiet"]["default"] / steps["quiet"]["before"]
    burst = steps["burst"]["default"] / steps["burst"]["before"]
    within = steps["busy"]["default"] / steps["busy"]["one thread"]
    faster = steps["busy"]["before"] / steps["busy"]["default"]
    targets = {
        "quiet: default / before": {"value": quiet, "target": f"<= {QUIET_WITHIN}", "met": quiet <= QUIET_WITHIN},
        "burst: default / before": {"value": burst, "target": f"<= {QUIET_WITHIN}", "met": burst <= QUIET_WITHIN},
        "busy: default / one thread": {"value": within, "target": f"<= {BUSY_WITHIN_ONE_THREAD}",
                                       "met": within <= BUSY_WITHIN_ONE_THREAD},
        "busy: before / default": {"value": faster, "target": f">= {BUSY_FASTER_THAN_BEFORE}",
                                   "met": faster >= BUSY_FASTER_THAN_BEFORE},
    }
    loads = {c: statistics.median(run["load_before"] for run in runs if run["condition"] == c) for c in CONDITIONS}
    return {"medians": medians, "targets": targets, "loads": loads}


def format_table(report: dict) -> str:
    lines = [f"| setting | {' | '.join(f'{c}: steps s | {c}: wall s' for c in CONDITIONS)} |",
             "| --- |" + " --- | --- |" * len(CONDITIONS)]
    for setting in SETTINGS:
        cells = []
        for condition in CONDITIONS:
            median = report["medians"][condition][setting]
            cells += [f"{median['steps_s']:.2f}", f"{median['wall_s']:.2f}"]
        lines.append(f"| {setting} | {' | '.join(cells)} |")
    lines.append("")
    cpus = report["config"]["cpus"]
    if report["loads"]["quiet"] > cpus / 2:
        lines.append(f"the 'quiet' runs started at a median 1-minute load of {report['loads']['quiet']:.1f} on {cpus} "
                     "CPUs: the machine was not quiet, and neither are those readings")
    for name, target in report["targets"].items():
        lines.append(f"{name}: {target['value']:.3f} (target {target['target']}): "
                     f"{'met' if target['met'] else 'missed'}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, len(CONDITIONS), figsize=(10, 7), squeeze=False)
    colors = {"before": "#888888", "default": "#1f77b4", "one thread": "#ff7f0e"}
    config = report["config"]
    for row, (key, label) in enumerate((("steps_s", "steps' time (s)"), ("wall_s", "wall time, start to exit (s)"))):
        for column, condition in enumerate(CONDITIONS):
            ax = axes[row][column]
            for x, setting in enumerate(SETTINGS):
                values = [run[key] for run in report["runs"]
                          if run["condition"] == condition and run["setting"] == setting]
                ax.bar(x, report["medians"][condition][setting][key], color=colors[setting], alpha=0.35, width=0.6)
                ax.scatter([x] * len(values), values, color=colors[setting], zorder=3, s=18)
            ax.set_xticks(range(len(SETTINGS)), SETTINGS)
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            where = {"quiet": "nothing started beside",
                     "burst": f"{config['busy']} processes busy for the first {BURST_S:g} s",
                     "busy": f"beside {config['busy']} busy processes"}[condition]
            ax.set_title(f"{where} (1-minute load at start: median {report['loads'][condition]:.1f})", fontsize=10)
    fig.suptitle(f"tiny/full, {config['steps']} steps, {config['nproc']} process(es), {config['cpus']} CPUs "
                 f"({config['date']})", fontsize=11)
    save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    measured = measure(args)
    report = {"config": {"command": "scripts/bench_cpu_threads.py " + " ".join(sys.argv[1:] if argv is None else argv),
                         "date": started, "rounds": args.rounds, "steps": args.steps, "busy": args.busy,
                         "nproc": args.nproc, "cpus": os.cpu_count(), "before_threads": measured["before_threads"],
                         "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                                    capture_output=True, text=True).stdout.strip()},
              "runs": measured["runs"], **summarise(measured["runs"])}
    write_report(report, format_table(report), args.out_json, plot, args.out_png)


if __name__ == "__main__":
    main()
