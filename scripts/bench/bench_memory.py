"""Benchmark the memory switches: peak memory and step time of {ordinary step, optimizer in backward} x
{whole logits, chunked loss} x {no AC, full AC}, on CPU, through the recipe's own training path; and, with
``--optimizers``, the optimizer state's precision: fp32 AdamW against torchao's 8-bit and 4-bit AdamW and bf16
weights with stochastic rounding.

    .venv/bin/python scripts/bench/bench_memory.py                 # llama_small_32k, batch 4 x 1024, fp32 (~10 min)
    .venv/bin/python scripts/bench/bench_memory.py --seq-len 256 --repeats 1      # a quick look
    .venv/bin/python scripts/bench/bench_memory.py --optimizers    # the optimizers (an hour or more on 2 cores)
    .venv/bin/python scripts/bench/bench_memory.py --ablation      # the switches added one by one (~10 min)

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

With ``--optimizers`` (full AC, the chunked loss, the ordinary step), for each optimizer: its state's bytes as
allocated (a quantized tensor's codes, scales and table), the step's peak and time as above (after a warm-up step,
which compiles torchao's update), each against fp32 AdamW; and the loss after ``--loss-steps`` steps of a real
``tune run`` of ``llama_small`` on the embedded data (the mean of the last 10 logged), against fp32 AdamW's.
Targets: 8-bit state <= 0.27x fp32 AdamW's, 4-bit <= 0.15x; the loss within 2 %.

With ``--ablation``, torchtune's ablation measured on a CPU: each switch that runs on a CPU added to the ones
before (the chunked loss, full AC, the step in backward, 8-bit AdamW), each row in a fresh process that runs two
steps as the recipe does (glibc set as ``runtime/process_memory.py`` sets it), its peak resident set against the
planner's estimate of it (the step and the process's fixed cost, measured as the run measures it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, write_report  # noqa: E402
from _measure import return_freed_memory_to_os, track_peak_rss  # noqa: E402

from torchtune_ac.config.components import Component  # noqa: E402
from torchtune_ac.config.meta_model import build_meta_model  # noqa: E402
from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan  # noqa: E402
from torchtune_ac.observability.third_party_noise import filter_known_noise  # noqa: E402
from torchtune_ac.run.assemble import AssemblyPlan, build_training  # noqa: E402
from torchtune_ac.parallel.fsdp import FSDPConfig  # noqa: E402
from torchtune_ac.runtime.distributed import DistributedContext  # noqa: E402
from torchtune_ac.runtime.dtypes import DType  # noqa: E402
from torchtune_ac.activation_checkpointing import ACConfig, ACMode  # noqa: E402
from torchtune_ac.training.objective import IGNORE_INDEX  # noqa: E402
from torchtune_ac.training.step import train_step  # noqa: E402

MiB = 2**20
CHUNKS = 8
CHUNK_TARGET = (0.70, 1.05)  # (share of the logits' bytes saved, max step time ratio)
IN_BACKWARD_TARGET = (0.80, 1.05)  # (share of the gradients' bytes saved, max step time ratio)
# --optimizers: name -> (optimizer component, its arguments, storage dtype); the first is the reference.
OPTIMIZERS = {
    "fp32 AdamW": ("torch.optim.AdamW", {}, "fp32"),
    "8-bit AdamW": ("torchao.optim.AdamW8bit", {}, "fp32"),
    "4-bit AdamW": ("torchao.optim.AdamW4bit", {}, "fp32"),
    "bf16 weights, stochastic rounding": ("torchao.optim._AdamW", {"bf16_stochastic_round": True}, "bf16"),
}
STATE_TARGETS = {"8-bit AdamW": 0.27, "4-bit AdamW": 0.15}
# --ablation: (label, AC mode, loss chunks, optimizer in backward, optimizer component), each row adding one.
ABLATION = [
    ("fp32 AdamW, no AC, whole logits", "none", 1, False, "torch.optim.AdamW"),
    ("+ chunked loss (8 chunks)", "none", 8, False, "torch.optim.AdamW"),
    ("+ full AC", "full", 8, False, "torch.optim.AdamW"),
    ("+ optimizer step in backward", "full", 8, True, "torch.optim.AdamW"),
    ("+ 8-bit AdamW (torchao)", "full", 8, True, "torchao.optim.AdamW8bit"),
]
LOSS_TARGET = 0.02
# Steps per epoch of the loss runs: the embedded data packs into 603 rows of 256 tokens, 150 batches of 4.
LOSS_STEPS_PER_EPOCH = 100


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
    parser.add_argument("--out-json", type=Path, default=None,
                        help="default: bench_results/bench_memory.json (bench_memory_optimizers.json)")
    parser.add_argument("--out-png", type=Path, default=None,
                        help="default: docs/images/bench_memory.png (bench_memory_optimizers.png)")
    parser.add_argument("--optimizers", action="store_true", help="measure the optimizers instead of the switches")
    parser.add_argument("--ablation", action="store_true", help="measure the switches added one by one, and plan them")
    parser.add_argument("--lr", type=float, default=3e-4, help="--optimizers: the learning rate of every optimizer")
    parser.add_argument("--loss-steps", type=int, default=200, help="--optimizers: steps of each training run")
    parser.add_argument("--loss-model", default="llama_small", help="--optimizers: the model the runs train")
    parser.add_argument("--loss-seq-len", type=int, default=256, help="--optimizers: packed rows of this length")
    parser.add_argument("--loss-batch-size", type=int, default=4)
    args = parser.parse_args(argv)
    name = ("bench_memory_optimizers" if args.optimizers else "bench_memory_ablation" if args.ablation
            else "bench_memory")
    args.out_json = args.out_json or REPO / "bench_results" / f"{name}.json"
    args.out_png = args.out_png or REPO / "docs" / "images" / f"{name}.png"
    return args


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
    model = build_training(build_meta_model(component), AssemblyPlan(dtype=DType.FP32, memory=plan, seed=args.seed),
                           ctx=ctx).model
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


def machine() -> dict:
    """What ran the benchmark: the processor's name, cores, and how busy the machine was when it started."""
    model = "unknown"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                      if line.startswith("model name")), model)
    return {"cpu": model, "cpu_count": os.cpu_count(), "machine": platform.machine(),
            "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def state_bytes_of(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the optimizers' state as allocated: a tensor subclass's inner tensors (torchao's codes, scales and
    lookup table), else the tensor's storage; the step counters left out."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for key, value in state.items():
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue
                local = value.to_local() if hasattr(value, "to_local") else value
                if is_traceable_wrapper_subclass(local):
                    names, _ = local.__tensor_flatten__()
                    total += sum(getattr(local, name).untyped_storage().nbytes() for name in names)
                else:
                    total += local.untyped_storage().nbytes()
    return total


def measure_optimizer(args: argparse.Namespace, name: str, batch: dict[str, torch.Tensor]) -> tuple[int, int, float]:
    """State bytes, the peak above the pre-step resident memory, and wall seconds of one step after a warm-up step,
    with full AC and the chunked loss."""
    from torchtune_ac.memory.feature import OptimizerSpec

    path, kwargs, dtype = OPTIMIZERS[name]
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    component = Component(key="model", path=f"torchtune_ac.models.{args.model}")
    optimizer = Component(key="optimizer", path=path, kwargs={"lr": args.lr, **kwargs})
    storage = DType(dtype)
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode.FULL), MemoryConfig(loss_chunks=CHUNKS),
                               build_meta_model(component), clip_grad_norm=None,
                               optimizer=OptimizerSpec(path, optimizer.kwargs), dtype=storage.torch, device="cpu")
    model = build_training(build_meta_model(component), AssemblyPlan(dtype=storage, memory=plan, seed=args.seed),
                           ctx=ctx).model
    stepper = plan.build_stepper(optimizer.instantiate, model)
    train_step(model, stepper, [batch], ctx=ctx, objective=plan.objective())  # allocates (and compiles) the state
    state = state_bytes_of(stepper.optimizers_to_checkpoint())
    return_freed_memory_to_os()
    before = psutil.Process().memory_info().rss
    with track_peak_rss() as peak:
        start = time.perf_counter()
        train_step(model, stepper, [batch], ctx=ctx, objective=plan.objective())
        seconds = time.perf_counter() - start
    del model, stepper
    gc.collect()
    return_freed_memory_to_os()
    return state, peak.peak_bytes - before, seconds


def final_loss(args: argparse.Namespace, name: str) -> dict:
    """A real ``tune run`` of ``--loss-model`` for ``--loss-steps`` steps with the optimizer ``name``: its losses."""
    path, kwargs, dtype = OPTIMIZERS[name]
    from torchtune_ac.embedded import ensure_embedded_checkpoint

    embedded = ensure_embedded_checkpoint()
    # As many epochs over the embedded data as --loss-steps needs (LOSS_STEPS_PER_EPOCH packed batches each).
    per_epoch = min(args.loss_steps, LOSS_STEPS_PER_EPOCH)
    epochs = -(-args.loss_steps // per_epoch)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["run", "full_finetune", "--config", "tiny/full", f"output_dir={tmp}/run",
                f"model._component_=torchtune_ac.models.{args.loss_model}", "checkpoint_dir=null",
                f"tokenizer.path={embedded}", f"max_seq_len={args.loss_seq_len}", "dataset.packed=true",
                f"batch_size={args.loss_batch_size}", f"epochs={epochs}", f"max_steps_per_epoch={per_epoch}",
                f"optimizer._component_={path}", f"optimizer.lr={args.lr}", "optimizer.weight_decay=0.0",
                *(f"+optimizer.{k}={json.dumps(v)}" for k, v in kwargs.items()), f"dtype={dtype}",
                "lr_scheduler=null", "log_every_n_steps=1", "save_every_n_steps=null"]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        start = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "torchtune_ac.cli", *argv], capture_output=True, text=True,
                                env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{name}: tune run exited {result.returncode}:\n{result.stderr[-3000:]}")
        records = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    return {"losses": losses, "final_loss": statistics.mean(losses[-10:]), "steps": len(losses),
            "run_s": time.perf_counter() - start}


def run_optimizer_benchmark(args: argparse.Namespace) -> dict:
    with torch.device("meta"):
        reference = build_meta_model(Component(key="model", path=f"torchtune_ac.models.{args.model}"))
    n_params = sum(p.numel() for p in reference.parameters())
    batch = make_batch(args, reference.args.vocab_size)
    names = list(OPTIMIZERS)
    states: dict[str, int] = {}
    peaks: dict[str, list[int]] = {n: [] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    progress = tqdm(total=args.repeats * len(names) + len(names), desc="bench_memory --optimizers", file=sys.stderr)
    for round_ in range(args.repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            states[name], peak, seconds = measure_optimizer(args, name, batch)
            peaks[name].append(peak)
            times[name].append(seconds)
            progress.update(1)
    losses = {}
    for name in names:
        losses[name] = final_loss(args, name)
        progress.update(1)
    progress.close()
    reference_name = names[0]
    rows = []
    for name in names:
        rows.append({
            "optimizer": name, "component": OPTIMIZERS[name][0], "dtype": OPTIMIZERS[name][2],
            "state_mib": states[name] / MiB, "state_ratio": states[name] / states[reference_name],
            "peak_mib": statistics.median(peaks[name]) / MiB, "peak_mib_all": [p / MiB for p in peaks[name]],
            "peak_ratio": statistics.median(peaks[name]) / statistics.median(peaks[reference_name]),
            "step_s": statistics.median(times[name]), "step_s_all": times[name],
            "time_ratio": statistics.median(t / r for t, r in zip(times[name], times[reference_name])),
            "final_loss": losses[name]["final_loss"], "losses": losses[name]["losses"],
            "loss_ratio": losses[name]["final_loss"] / losses[reference_name]["final_loss"],
            "loss_run_s": losses[name]["run_s"],
        })
    by_name = {row["optimizer"]: row for row in rows}
    targets = [{"target": f"{name}: state <= {limit}x fp32 AdamW's", "value": by_name[name]["state_ratio"],
                "met": by_name[name]["state_ratio"] <= limit} for name, limit in STATE_TARGETS.items()]
    targets += [{"target": f"{name}: loss after {args.loss_steps} steps within {LOSS_TARGET:.0%} of fp32 AdamW's",
                 "value": by_name[name]["loss_ratio"] - 1, "met": abs(by_name[name]["loss_ratio"] - 1) <= LOSS_TARGET}
                for name in names[1:]]
    return {
        "model": args.model, "parameters": n_params, "batch_size": args.batch_size, "seq_len": args.seq_len,
        "repeats": args.repeats, "chunks": CHUNKS, "ac": "full", "lr": args.lr, "loss_model": args.loss_model,
        "loss_steps": args.loss_steps, "loss_batch": f"{args.loss_batch_size} x {args.loss_seq_len} packed",
        "torch": torch.__version__, "threads": torch.get_num_threads(), **machine(),
        "date": time.strftime("%Y-%m-%d"), "rows": rows, "targets": targets,
    }


def format_optimizer_table(report: dict) -> str:
    lines = [f"{report['model']} ({report['parameters']:,} parameters), batch {report['batch_size']} x "
             f"{report['seq_len']}, full AC, {report['chunks']}-chunk loss; medians of {report['repeats']} interleaved "
             f"rounds; loss: {report['loss_model']}, {report['loss_steps']} steps of {report['loss_batch']}, "
             f"lr {report['lr']:g}; on {report['cpu']} ({report['cpu_count']} cores)",
             f"{'optimizer':<34} {'state MiB':>9} {'vs fp32':>7} {'peak MiB':>9} {'vs fp32':>7} {'step s':>7} "
             f"{'vs fp32':>7} {'loss':>7} {'vs fp32':>8}"]
    for r in report["rows"]:
        lines.append(f"{r['optimizer']:<34} {r['state_mib']:>9.1f} {r['state_ratio']:>7.3f} {r['peak_mib']:>9.0f} "
                     f"{r['peak_ratio']:>7.2f} {r['step_s']:>7.2f} {r['time_ratio']:>7.2f} {r['final_loss']:>7.4f} "
                     f"{r['loss_ratio'] - 1:>+8.2%}")
    for target in report["targets"]:
        lines.append(f"{'MET' if target['met'] else 'MISSED':<6} {target['target']}: {target['value']:.3f}")
    return "\n".join(lines)


def plot_optimizers(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.4))
    names = [r["optimizer"] for r in report["rows"]]
    left.bar(range(len(names)), [r["state_mib"] for r in report["rows"]], color="tab:brown")
    for i, r in enumerate(report["rows"]):
        left.annotate(f"{r['state_ratio']:.2f}x", (i, r["state_mib"]), ha="center", va="bottom", fontsize=8)
    left.set_xticks(range(len(names)))
    left.set_xticklabels([n.replace(", ", ",\n") for n in names], fontsize=8)
    left.set_ylabel("optimizer state (MiB)")
    left.set_title(f"{report['model']}: state as allocated (labels: vs fp32 AdamW)", fontsize=9)
    for r in report["rows"]:
        right.plot(range(1, len(r["losses"]) + 1), r["losses"], label=f"{r['optimizer']} ({r['final_loss']:.3f})",
                   linewidth=1)
    right.set_xlabel("step")
    right.set_ylabel("loss")
    right.set_title(f"{report['loss_model']}, {report['loss_batch']} (final: mean of the last 10)", fontsize=9)
    right.legend(fontsize=7)
    save_figure(fig, path, dpi=110)


def _ablation_plan(args: argparse.Namespace, row: tuple):
    from torchtune_ac.memory.feature import OptimizerSpec

    _, ac, chunks, in_backward, optimizer = row
    component = Component(key="model", path=f"torchtune_ac.models.{args.model}")
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode(ac)), MemoryConfig(loss_chunks=chunks, optimizer_in_bwd=in_backward),
                               build_meta_model(component), clip_grad_norm=None, optimizer=OptimizerSpec(optimizer),
                               device="cpu")
    return component, Component(key="optimizer", path=optimizer, kwargs={"lr": args.lr}), plan


def ablation_worker(args: argparse.Namespace, index: int) -> dict:
    """One ablation row in this (fresh) process: the resident set before the model, two steps as the recipe runs
    them, and the process's peak resident set."""
    import resource

    from torchtune_ac.runtime.process_memory import fixed_bytes, follow_live_tensors

    follow_live_tensors()
    component, optimizer, plan = _ablation_plan(args, ABLATION[index])
    fixed = fixed_bytes(torch.device("cpu"))
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = build_training(build_meta_model(component), AssemblyPlan(dtype=DType.FP32, memory=plan, seed=args.seed),
                           ctx=ctx).model
    stepper = plan.build_stepper(optimizer.instantiate, model)
    batch = make_batch(args, model.args.vocab_size)
    for _ in range(2):
        train_step(model, stepper, [batch], ctx=ctx, objective=plan.objective())
    return {"fixed": fixed, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "state": state_bytes_of(stepper.optimizers_to_checkpoint())}


def run_ablation(args: argparse.Namespace) -> dict:
    from torchtune_ac.memory.planner import Workload, estimate_memory

    rows = []
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for index, row in enumerate(tqdm(ABLATION, desc="bench_memory --ablation", file=sys.stderr)):
        result = subprocess.run([sys.executable, __file__, "--ablation-worker", str(index), *sys.argv[1:]],
                                capture_output=True, text=True, env=env)
        if result.returncode != 0:
            raise RuntimeError(f"{row[0]}: {result.stderr[-3000:]}")
        measured = json.loads(result.stdout.strip().splitlines()[-1])
        component, optimizer, plan = _ablation_plan(args, row)
        workload = Workload(args.batch_size, args.seq_len).with_settings(plan.settings)
        estimate, = estimate_memory(component.instantiate, optimizer.instantiate, workload, [plan.ac])
        device = estimate.total + measured["fixed"]
        rows.append({"switches": row[0], "planned_gib": device / 2**30, "planned_step_gib": estimate.total / 2**30,
                     "fixed_gib": measured["fixed"] / 2**30, "measured_gib": measured["peak"] / 2**30,
                     "ratio": device / measured["peak"], "optimizer_state_mib": measured["state"] / MiB,
                     "planned_optimizer_mib": estimate.optimizer / MiB})
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_meta_model(
            Component(key="model", path=f"torchtune_ac.models.{args.model}")).parameters())
    return {"model": args.model, "parameters": n_params, "batch_size": args.batch_size, "seq_len": args.seq_len,
            "dtype": "fp32", "torch": torch.__version__, "threads": torch.get_num_threads(), **machine(),
            "date": time.strftime("%Y-%m-%d"), "rows": rows}


def format_ablation_table(report: dict) -> str:
    lines = [f"{report['model']} ({report['parameters']:,} parameters), batch {report['batch_size']} x "
             f"{report['seq_len']}, fp32, 1 process; on {report['cpu']} ({report['cpu_count']} cores); GiB",
             f"{'switches':<34} {'planned':>8} {'(process)':>9} {'measured':>8} {'planned/measured':>16} "
             f"{'state MiB':>9}"]
    for r in report["rows"]:
        lines.append(f"{r['switches']:<34} {r['planned_gib']:>8.2f} {r['fixed_gib']:>9.2f} {r['measured_gib']:>8.2f} "
                     f"{r['ratio']:>16.2f} {r['optimizer_state_mib']:>9.0f}")
    return "\n".join(lines)


def plot_ablation(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8.5, 4.4))
    labels = [r["switches"].replace(", ", ",\n").replace("+ ", "+\n", 1) for r in report["rows"]]
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [r["measured_gib"] for r in report["rows"]], 0.4, label="measured peak RSS",
           color="tab:blue")
    ax.bar([x + 0.2 for x in xs], [r["planned_gib"] for r in report["rows"]], 0.4, label="tune plan's device estimate",
           color="tab:gray")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GiB")
    ax.set_title(f"{report['model']}, batch {report['batch_size']} x {report['seq_len']}, fp32, CPU: each switch "
                 "added to the ones before", fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main(argv: Optional[list[str]] = None) -> None:
    filter_known_noise()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--ablation-worker"]:
        print(json.dumps(ablation_worker(parse_args(argv[2:]), int(argv[1]))))
        return
    args = parse_args(argv)
    if args.ablation:
        report = run_ablation(args)
        write_report(report, format_ablation_table(report), args.out_json, plot_ablation, args.out_png)
        return
    if args.optimizers:
        report = run_optimizer_benchmark(args)
        write_report(report, format_optimizer_table(report), args.out_json, plot_optimizers, args.out_png)
        return
    report = run_benchmark(args)
    write_report(report, format_table(report), args.out_json, plot, args.out_png)


if __name__ == "__main__":
    main()
