"""``bench_train.py --against REV``: the working tree against a git revision, as real ``tune run`` processes.

The revision is checked out into a temporary ``git worktree`` (nothing to compile: each side runs with its own
checkout first on ``PYTHONPATH``, in the same Python environment). Both sides train the same workload from the
same files, which this script writes once:

  * the model: a 6.6 M-parameter grouped-query Llama (``WORKLOAD_ARGS``), initialised from the seed and saved as a
    Hugging Face checkpoint, which both sides load through ``torchtune_ac.models.from_hf_config``;
  * the data: the embedded instruction data and tokenizer, copied here so that both sides read the same bytes,
    packed into rows of 512 tokens, batch 4, fp32, AdamW, no gradient clipping.

Each side is one ``tune run`` process (``_step_worker.py``: the CLI, with a hand-over around each step), both
children of this one and alive together, taking turns: one step of A, then B, B, A, A, B, ... (A the revision, B
the working tree), so that the load of a shared machine, which moves from second to second, falls on both sides
alike; the side not stepping waits on a pipe and uses no CPU. A step's time is one whole iteration of the
recipe's loop (the data, the step, the scheduler, the metrics line), from the moment it was handed the turn to the
end of its ``train_step``. ``rounds`` such pairs of processes run one after the other, the first pair started
A then B, the next B then A. A side's peak resident set is the kernel's (``wait4``'s ``ru_maxrss``), what a
container's memory limit sees. The load average is recorded at every turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_step_worker.py"

# The workload: 6,557,952 parameters, 8 query heads sharing 4 K/V heads, the embedded tokenizer's
# 512-token vocabulary.
WORKLOAD_ARGS = dict(vocab_size=512, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, intermediate_dim=768,
                     max_seq_len=512)
BATCH_SIZE = 4
SEQ_LEN = 512
SIDES = ("A", "B")  # A: the revision; B: the working tree


@dataclass(frozen=True)
class Side:
    """One side of the comparison: a checkout and what to call it."""

    label: str
    root: Path
    revision: str
    overrides: tuple[str, ...] = ()


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def describe_working_tree() -> str:
    """``HEAD``'s short hash, with ``+changes`` when tracked files differ from it."""
    head = git("rev-parse", "--short", "HEAD")
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


@contextlib.contextmanager
def revision_checkout(revision: str, parent: Path) -> Iterator[Side]:
    """``revision`` checked out in a temporary worktree under ``parent``; the worktree is removed afterwards."""
    commit = git("rev-parse", "--verify", f"{revision}^{{commit}}")
    path = parent / "revision"
    git("worktree", "add", "--detach", str(path), commit)
    try:
        yield Side("A", path, f"{revision} ({commit[:10]})")
    finally:
        git("worktree", "remove", "--force", str(path))


def write_workload(directory: Path, seed: int) -> Path:
    """Write the workload's checkpoint, tokenizer, data and config into ``directory``; returns the config's path."""
    import torch

    from torchtune_ac.data import EMBEDDED_INSTRUCT_PATH, EMBEDDED_TOKENIZER_DIR
    from torchtune_ac.models import save_hf
    from torchtune_ac.models.llama import Llama, LlamaArgs

    checkpoint = directory / "checkpoint"
    torch.manual_seed(seed)
    model = Llama(LlamaArgs(**WORKLOAD_ARGS))
    model.init_weights()
    save_hf(model, checkpoint)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(EMBEDDED_TOKENIZER_DIR) / name, checkpoint / name)
    data = directory / "instruct.jsonl"
    shutil.copy(EMBEDDED_INSTRUCT_PATH, data)
    config = directory / "workload.yaml"
    config.write_text(f"""\
output_dir: {directory / "unused"}
checkpoint_dir: {checkpoint}
model:
  _component_: torchtune_ac.models.from_hf_config
tokenizer:
  _component_: torchtune_ac.data.load_tokenizer
  path: {checkpoint}
dataset:
  _component_: torchtune_ac.data.instruct_dataset
  source: {data}
  train_on_input: false
  packed: true
max_seq_len: {SEQ_LEN}
seed: {seed}
shuffle: true
batch_size: {BATCH_SIZE}
epochs: 1
gradient_accumulation_steps: 1
clip_grad_norm: null
optimizer:
  _component_: torch.optim.AdamW
  lr: 3.0e-4
  weight_decay: 0.0
lr_scheduler: null
device: cpu
dtype: fp32
compile: false
log_every_n_steps: 1
""")
    return config


class Worker:
    """One side's ``tune run`` process, stepping when handed the turn (see ``_step_worker.py``)."""

    def __init__(self, side: Side, config: Path, steps: int, scratch: Path) -> None:
        self.side = side
        self.output_dir = scratch / f"run_{side.label}"
        self.log = open(scratch / f"stderr_{side.label}.log", "w+")
        go_read, self._go = os.pipe()
        self._reports, report_write = os.pipe()
        argv = [sys.executable, str(WORKER), str(go_read), str(report_write), "run", "full_finetune", "--config",
                str(config), f"output_dir={self.output_dir}", f"max_steps_per_epoch={steps}", *side.overrides]
        self.process = subprocess.Popen(argv, cwd=scratch, env={**os.environ, "PYTHONPATH": str(side.root)},
                                        stdout=subprocess.DEVNULL, stderr=self.log, pass_fds=(go_read, report_write))
        os.close(go_read)
        os.close(report_write)
        self._lines = os.fdopen(self._reports, "r")
        self.peak_rss_gib = float("nan")

    def _read(self) -> dict:
        line = self._lines.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"side {self.side.label} ({self.side.revision}): tune run stopped early:\n"
                               f"{self.log.read()[-3000:]}")
        return json.loads(line)

    def wait_ready(self) -> None:
        """Wait until the run has set up and reached its first step."""
        self._read()

    def step(self) -> dict:
        """Hand the run the turn; returns its step's ``{"time": s, "loss": x}`` once it is done."""
        os.write(self._go, b"g")
        return self._read()

    def finish(self) -> None:
        """Let the run end (save, exit) and read its peak resident set."""
        os.write(self._go, b"g")
        os.close(self._go)
        _, status, usage = os.wait4(self.process.pid, 0)
        self.process.returncode = os.waitstatus_to_exitcode(status)
        self._lines.close()
        if self.process.returncode != 0:
            self.log.seek(0)
            raise RuntimeError(f"side {self.side.label} ({self.side.revision}): tune run exited "
                               f"{self.process.returncode}:\n{self.log.read()[-3000:]}")
        self.log.close()
        shutil.rmtree(self.output_dir, ignore_errors=True)
        self.peak_rss_gib = usage.ru_maxrss * 1024 / 2**30


def run_pair(sides: dict[str, Side], first: str, config: Path, steps: int, warmup: int, scratch: Path) -> dict:
    """One process per side, stepping in turns A B B A ... (``first`` takes the first turn and starts first)."""
    order = [first, "B" if first == "A" else "A"]
    workers = {label: Worker(sides[label], config, steps, scratch) for label in order}
    steps_of = {label: [] for label in SIDES}
    loads = []
    try:
        for label in order:
            workers[label].wait_ready()
        for i in range(steps):
            for label in (order if i % 2 == 0 else order[::-1]):
                loads.append(os.getloadavg()[0])
                steps_of[label].append(workers[label].step())
        for worker in workers.values():
            worker.finish()
    except BaseException:
        for worker in workers.values():
            worker.process.kill()
            worker.process.wait()
        raise
    return {
        "first": first,
        "sides": {label: {"step_times_s": [s["time"] for s in steps_of[label][warmup:]],
                          "untimed_step_times_s": [s["time"] for s in steps_of[label][:warmup]],
                          "losses": [s["loss"] for s in steps_of[label]],
                          "peak_rss_gib": workers[label].peak_rss_gib} for label in SIDES},
        "load_average_1min": loads,
    }


def merge_overrides(common: Sequence[str], own: Sequence[str]) -> tuple[str, ...]:
    """``common`` config overrides with ``own`` replacing those of the same key (``key=value`` each)."""
    merged = {item.split("=", 1)[0]: item for item in common}
    merged.update({item.split("=", 1)[0]: item for item in own})
    return tuple(merged.values())


def compare(revision: str, *, overrides: Sequence[str], overrides_a: Sequence[str] = (), steps: int, warmup: int,
            rounds: int, seed: int, progress: Callable[[str], None] = lambda text: None) -> dict:
    """Run the working tree (B) against ``revision`` (A), step by step A B B A; returns the report. Both sides
    take ``overrides``; A's ``overrides_a`` replace those of the same key."""
    with tempfile.TemporaryDirectory(prefix="bench_train_against_") as tmp:
        scratch = Path(tmp)
        config = write_workload(scratch, seed)
        with revision_checkout(revision, scratch) as checkout:
            a = dataclasses.replace(checkout, overrides=merge_overrides(overrides, overrides_a))
            sides = {"A": a, "B": Side("B", REPO, f"working tree ({describe_working_tree()})", tuple(overrides))}
            pairs = []
            for i in range(rounds):
                first = "A" if i % 2 == 0 else "B"
                progress(f"pair {i + 1}/{rounds}: {steps} steps each, in turns, {first} first")
                pairs.append(run_pair(sides, first, config, steps, warmup, scratch))
    report = summarise(pairs, {label: side.revision for label, side in sides.items()})
    for label, side in sides.items():
        report["sides"][label]["overrides"] = list(side.overrides)
    return report


def summarise(pairs: list[dict], revisions: dict[str, str]) -> dict:
    """Pool each side's timed steps; the ratio is B's median step over A's (below 1: the working tree is faster)."""
    per_side = {}
    for label in SIDES:
        times = [t for pair in pairs for t in pair["sides"][label]["step_times_s"]]
        per_side[label] = {"revision": revisions[label], "median_step_time_s": statistics.median(times),
                           "min_step_time_s": min(times),
                           "peak_rss_gib": max(pair["sides"][label]["peak_rss_gib"] for pair in pairs)}
    a, b = per_side["A"], per_side["B"]
    # Each step of B over the step of A it was paired with (the neighbouring turn): how much the ratio moves.
    step_ratios = [tb / ta for pair in pairs
                   for ta, tb in zip(pair["sides"]["A"]["step_times_s"], pair["sides"]["B"]["step_times_s"])]
    pair_ratios = [statistics.median(pair["sides"]["B"]["step_times_s"])
                   / statistics.median(pair["sides"]["A"]["step_times_s"]) for pair in pairs]
    first = pairs[0]["sides"]
    return {
        "sides": per_side,
        "step_time_ratio": b["median_step_time_s"] / a["median_step_time_s"],
        "step_time_ratio_per_pair": pair_ratios,
        "paired_step_ratio_median": statistics.median(step_ratios),
        "paired_step_ratio_quartiles": statistics.quantiles(step_ratios, n=4) if len(step_ratios) > 1 else [],
        "fastest_step_ratio": b["min_step_time_s"] / a["min_step_time_s"],
        "peak_rss_ratio": b["peak_rss_gib"] / a["peak_rss_gib"],
        "max_loss_difference": max(abs(x - y) for x, y in zip(first["A"]["losses"], first["B"]["losses"])),
        "pairs": pairs,
    }


def format_report(report: dict) -> str:
    a, b = report["sides"]["A"], report["sides"]["B"]
    loads = [load for pair in report["pairs"] for load in pair["load_average_1min"]]
    lines = [f"{'side':<4} {'revision':<44} {'median s/step':>13} {'fastest':>8} {'peak RSS GiB':>12}"]
    for label, side in (("A", a), ("B", b)):
        lines.append(f"{label:<4} {side['revision']:<44} {side['median_step_time_s']:>13.3f} "
                     f"{side['min_step_time_s']:>8.3f} {side['peak_rss_gib']:>12.3f}")
    quartiles = report["paired_step_ratio_quartiles"]
    lines += [
        f"B / A: median step time {report['step_time_ratio']:.3f} (per pair of processes: "
        f"{', '.join(f'{r:.3f}' for r in report['step_time_ratio_per_pair'])}; step by neighbouring step: median "
        f"{report['paired_step_ratio_median']:.3f}"
        + (f", quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}" if quartiles else "") + ")",
        f"B / A: fastest step {report['fastest_step_ratio']:.3f}, peak RSS {report['peak_rss_ratio']:.3f}; losses "
        f"differ by at most {report['max_loss_difference']:.1e}",
        f"1-minute load average during the steps: {min(loads):.2f} to {max(loads):.2f} on {os.cpu_count()} CPUs"
        + ("  (busy machine: repeat when it is quieter)" if max(loads) > 1.5 * (os.cpu_count() or 1) else ""),
    ]
    return "\n".join(lines)


def plot(panels: Sequence[tuple[str, dict]], path: Path) -> None:
    """Draw each (title, report) as a panel: every timed step of A and B in the order taken (pairs of processes
    one after the other, a gap between them), each side's median as a line, the ratio of medians in the title.

    One look shows what the table's ratio hides: whether the two sides' steps are apart everywhere or a few slow
    steps of a loaded machine moved a median."""
    from _benchlib import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False, sharey=False)
    colors = {"A": "tab:gray", "B": "tab:blue"}
    for ax, (title, report) in zip(axes[0], panels):
        start = 0
        for pair in report["pairs"]:
            for label in SIDES:
                times = pair["sides"][label]["step_times_s"]
                ax.plot(range(start, start + len(times)), times, "o", ms=3, color=colors[label],
                        label=None if start else f"{label}: {report['sides'][label]['revision']}"[:48])
            start += len(pair["sides"]["A"]["step_times_s"]) + 2
        for label in SIDES:
            ax.axhline(report["sides"][label]["median_step_time_s"], color=colors[label], lw=1, ls="--")
        loads = [load for pair in report["pairs"] for load in pair["load_average_1min"]]
        ax.set_title(f"{title}\nB / A = {report['step_time_ratio']:.3f} (load {min(loads):.1f}-{max(loads):.1f})",
                     fontsize=9)
        ax.set_xlabel("timed step, in the order taken (pairs of processes apart)", fontsize=8)
        ax.set_ylabel("s / step", fontsize=8)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path)
