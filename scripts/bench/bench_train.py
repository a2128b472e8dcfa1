"""Benchmark the recipe's training step: against a git revision of this project, against a plain Hugging Face
transformers training loop, and on a GPU.

    .venv/bin/python scripts/bench/bench_train.py --against main --quick   # this checkout against main (~2 min, 2 cores)
    .venv/bin/python scripts/bench/bench_train.py --against HEAD~1         # the same, 2 x A B B A, longer runs (~6 min)
    .venv/bin/python scripts/bench/bench_train.py                     # llama_small, batch 4 x 1024, fp32 (~10 min, 2 cores)
    .venv/bin/python scripts/bench/bench_train.py --seq-len 128 --steps 2
    .venv/bin/python scripts/bench/bench_train.py --redraw bench_results/bench_train_against/06_*_quiet.json  # charts of saved runs

With ``--against REV`` the working tree (B) and ``REV`` (A, checked out in a temporary ``git worktree``) run the same
workload as real ``tune run`` processes, interleaved A B B A: a 6.6 M-parameter grouped-query Llama, packed rows of
512 tokens, batch 4, fp32, AdamW, on CPU (``scripts/bench/_against.py``). It prints the ratio of median step times
(B / A: below 1, the working tree is faster) and of peak resident sets. Run it before landing any change to the
step's path (model, attention, loss, optimizer, allocator, data collation). ``--ac`` and ``--set key=value``
change the workload on both sides.

Without ``--against``, it compares with Hugging Face:

Both sides start from the same Hugging Face checkpoint (initialised once from the seed and written with
``save_hf``), train on the same seeded batches with the same AdamW hyperparameters, and optimise the same
objective (mean next-token cross-entropy over every target token):

  * ours: ``build_training`` (the recipe's build -> AC -> load path, world size 1) + ``train_step``;
  * Hugging Face: ``LlamaForCausalLM`` (SDPA attention) + ``torch.optim.AdamW``; full AC is
    ``activation_checkpointing_enable`` (formerly ``gradient_checkpointing_enable``) with
    ``use_reentrant=False``. The loop measures the gradient norm, as ``train_step`` always does (and as the
    HF TrainingLoop does by default), so both sides do the same work.

Per AC setting, warm-up steps and then timed steps alternate between the two sides (ours, HF, HF, ours, ...)
so that machine drift (other processes, thermals) hits both equally. Reports median step time, tokens/s and
the ratio ours / HF; the target is a ratio >= 1 for every setting. Two cross-checks for a shared machine are
reported next to it: the same ratio from each side's fastest step, and from median process CPU time per step.
Writes a JSON file and a bar chart.

With ``--device cuda`` (``scripts/gpu/gpu_check.sh`` runs it) it measures the recipe's step alone on the GPU, in bf16
with ``compile`` by default, for each AC setting: tokens/s, MFU (the model's FLOPs per second, counted as
``6 x parameters x tokens`` plus attention's ``12 x layers x heads x head_dim x sum(length^2)`` over the documents
of each row, recompute not counted, over the device's dense bf16 peak; ``mfu_whole_rows`` counts attention over
whole rows, as the figures before 2026-11-29 did), and the peak allocated and reserved memory against the planner's estimate (the
step's estimate plus the process's fixed cost measured before the model, as ``tune plan`` counts it). Targets: MFU
>= 40 % on a 1B-class model; the estimate within 15 % of the reserved peak.

    python scripts/bench/bench_train.py --device cuda --model llama3_2_1b --batch-size 4 --seq-len 2048 \
        --out-json bench_results/gpu_bench_train.json
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import transformers
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, write_report  # noqa: E402
from _profile_step import attention_flops  # noqa: E402

from torchtune_ac import models  # noqa: E402
from torchtune_ac.config.components import Component  # noqa: E402
from torchtune_ac.config.meta_model import build_meta_model  # noqa: E402
from torchtune_ac.data.collate import collate_batch  # noqa: E402
from torchtune_ac.memory.plan import MemoryConfig, resolve_memory_plan  # noqa: E402
from torchtune_ac.observability.third_party_noise import filter_known_noise  # noqa: E402
from torchtune_ac.run.assemble import AssemblyPlan, build_training  # noqa: E402
from torchtune_ac.parallel.fsdp import FSDPConfig  # noqa: E402
from torchtune_ac.runtime.distributed import DistributedContext  # noqa: E402
from torchtune_ac.runtime.dtypes import DType  # noqa: E402
from torchtune_ac.runtime.allocator import use_expandable_segments_by_default  # noqa: E402
from torchtune_ac.runtime.cpu_threads import set_thread_defaults  # noqa: E402
from torchtune_ac.runtime.process_memory import cublas_workspace_bytes  # noqa: E402
from torchtune_ac.activation_checkpointing import ACConfig, ACMode  # noqa: E402
from torchtune_ac.training.objective import IGNORE_INDEX  # noqa: E402
from torchtune_ac.training.step import move_batch, train_step  # noqa: E402

SETTINGS = ("none", "full")
SIDES = ("ours", "hf")
# Same optimizer on both sides; foreach/fused are left at torch's defaults for both.
ADAMW_KWARGS = {"lr": 2e-5, "weight_decay": 0.0}
# First-step losses of the two sides must agree this closely, or they are not optimising the same thing.
LOSS_TOLERANCE = 1e-4
# Target: ours at least as fast as Hugging Face in every setting.
TARGET_MIN_RATIO = 1.0

StepFn = Callable[[int], float]
DEFAULT_JSON = REPO / "bench_results" / "bench_train.json"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", metavar="REV", default=None,
                        help="compare the working tree with this git revision, A B B A, as tune run processes")
    parser.add_argument("--quick", action="store_true",
                        help="--against: one A B B A block of 10-step runs (about 2 minutes on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None, help="--against: A B B A blocks (default 2; --quick 1)")
    parser.add_argument("--ac", default="none", help="--against: ac_mode of both sides (none, full, selective, auto)")
    parser.add_argument("--profile", action="store_true",
                        help="profile the working tree's step on --against's workload, with its MFU (no --against)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="--against: a config override for both sides (repeatable)")
    parser.add_argument("--set-a", action="append", default=[], metavar="KEY=VALUE",
                        help="--against: a config override for the revision's side only, replacing --set's of that "
                             "key (repeatable; --against HEAD --set-a ac_mode=full compares two settings)")
    parser.add_argument("--model", default="llama_small", help="builder name in torchtune_ac.models")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side and setting")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per side and setting, first")
    parser.add_argument("--settings", default="none,full", help="comma-separated AC settings: none, full")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--out-png", type=Path, default=None,
                        help="the chart (default: docs/images/bench_train.png; with --against, beside --out-json; "
                             "with --redraw, docs/images/bench_train_against.png)")
    parser.add_argument("--redraw", type=Path, nargs="+", metavar="JSON", default=None,
                        help="draw --against reports saved before (one panel each, titled by the file's name) to "
                             "--out-png; nothing is run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the recipe's step alone on the GPU, with MFU and memory against the plan")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default=None, help="default: fp32 on cpu, bf16 on cuda")
    parser.add_argument("--compile", choices=("true", "false"), default=None,
                        help="compile each block (default: false on cpu, true on cuda)")
    parser.add_argument("--packed", action="store_true",
                        help="cuda: packed rows of documents of random lengths (per-document attention, varlen_attn)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak (default: from its name, e.g. 989 for an H100 SXM)")
    args = parser.parse_args(argv)
    if args.redraw is not None:
        missing = [str(path) for path in args.redraw if not path.is_file()]
        if missing:
            parser.error(f"--redraw: no such file: {', '.join(missing)}")
        args.out_png = args.out_png or REPO / "docs" / "images" / "bench_train_against.png"
        return args
    if args.profile and args.against is not None:
        parser.error("--profile measures the working tree alone: leave out --against")
    if args.profile:
        return args
    if args.against is not None:
        args.rounds = args.rounds or (1 if args.quick else 2)
        if args.rounds < 1:
            parser.error(f"--rounds={args.rounds}: must be at least 1")
        return args
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.compile = (args.compile or ("true" if args.device == "cuda" else "false")) == "true"
    if args.device == "cpu" and (args.dtype != "fp32" or args.compile):
        parser.error("--dtype bf16 and --compile true are measured with --device cuda only (the CPU comparison with "
                     "Hugging Face runs fp32, eager)")
    args.settings = [s.strip().lower() for s in args.settings.split(",")]
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown or len(set(args.settings)) != len(args.settings):
        parser.error(f"--settings {','.join(args.settings)}: each of {', '.join(SETTINGS)} at most once "
                     "(Hugging Face has no selective AC to compare against)")
    if not callable(getattr(models, args.model, None)):
        parser.error(f"--model {args.model!r}: no such builder in torchtune_ac.models")
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.seq_len < 2:
        parser.error(f"--seq-len={args.seq_len}: must be at least 2 (one target token per row)")
    if args.warmup < 0:
        parser.error(f"--warmup={args.warmup}: must be 0 or more")
    return args


def write_checkpoint(model_name: str, seed: int, out_dir: Path) -> int:
    """Initialise ``model_name`` from ``seed`` and save it as a Hugging Face checkpoint; returns its vocab size."""
    torch.manual_seed(seed)
    model = getattr(models, model_name)()
    model.init_weights()
    models.save_hf(model, out_dir)
    return model.args.vocab_size


def make_batches(n: int, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """``n`` random token batches ``[batch_size, seq_len]``, the same for a given seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator) for _ in range(n)]


def shift_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Targets for ``train_step``: ``labels[:, i] = tokens[:, i + 1]``; the last position has none."""
    ignore = torch.full_like(tokens[:, :1], IGNORE_INDEX)
    return torch.cat([tokens[:, 1:], ignore], dim=1)  # [b, s]


def build_ours(model_name: str, checkpoint_dir: Path, setting: str, batches: list[torch.Tensor],
               seed: int) -> tuple[StepFn, str]:
    """The recipe's model, optimizer and step on one CPU process.

    Returns:
        ``step(i)`` training on ``batches[i]`` and returning the loss, and the AC plan as text.
    """
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    component = Component(key="model", path=f"torchtune_ac.models.{model_name}")
    # The recipe's own resolution of the memory switches (default loss_chunks, no optimizer in backward).
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode(setting)), MemoryConfig(), build_meta_model(component),
                               clip_grad_norm=None)
    model = build_training(build_meta_model(component),
                           AssemblyPlan(dtype=DType.FP32, memory=plan, checkpoint_dir=str(checkpoint_dir),
                                        seed=seed), ctx=ctx).model
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_KWARGS)
    micro_batches = [[{"tokens": tokens, "labels": shift_labels(tokens)}] for tokens in batches]

    def step(i: int) -> float:
        return train_step(model, optimizer, micro_batches[i], ctx=ctx, objective=plan.objective(compiled=args.compile)).loss

    return step, str(plan.ac)


def build_hf(checkpoint_dir: Path, setting: str, batches: list[torch.Tensor]) -> StepFn:
    """A plain Hugging Face loop: ``LlamaForCausalLM`` (SDPA), AdamW, full AC through HF's own switch.

    Returns:
        ``step(i)`` training on ``batches[i]`` and returning the loss.
    """
    model = transformers.LlamaForCausalLM.from_pretrained(
        checkpoint_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    if setting == "full":
        # The current name of ``gradient_checkpointing_enable`` (a deprecated alias since transformers 5).
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW_KWARGS)

    def step(i: int) -> float:
        # HF shifts the labels itself, so it gets the unshifted tokens; no KV cache while training.
        loss = model(input_ids=batches[i], labels=batches[i], use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def run_setting(args: argparse.Namespace, setting: str, checkpoint_dir: Path, batches: list[torch.Tensor],
                bar: tqdm) -> dict:
    """Warm up and time both sides on one AC setting, alternating which side goes first each round."""
    ours, plan = build_ours(args.model, checkpoint_dir, setting, batches, args.seed)
    steps = {"ours": ours, "hf": build_hf(checkpoint_dir, setting, batches)}
    losses: dict[str, list[float]] = {side: [] for side in SIDES}
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    cpu_times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(args.warmup + args.steps):
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        for side in order:
            bar.set_postfix(setting=setting, side=side, step=i)
            start, cpu_start = time.perf_counter(), time.process_time()
            losses[side].append(steps[side](i))
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if i >= args.warmup:
                times[side].append(elapsed)
                cpu_times[side].append(cpu_elapsed)
            bar.update(1)
        if i == 0:
            check_first_losses(setting, losses["ours"][0], losses["hf"][0])
    del steps, ours

    tokens = args.batch_size * args.seq_len
    entry: dict = {"setting": setting, "plan": plan}
    for side in SIDES:
        median = statistics.median(times[side])
        entry[side] = {"step_times_s": times[side], "median_step_time_s": median, "tokens_per_second": tokens / median,
                       "min_step_time_s": min(times[side]), "cpu_times_s": cpu_times[side],
                       "median_cpu_time_s": statistics.median(cpu_times[side]), "losses": losses[side]}
    entry["ratio"] = entry["ours"]["tokens_per_second"] / entry["hf"]["tokens_per_second"]
    # Two views less exposed to other processes sharing the CPU: the fastest step of each side (interference
    # only ever adds time) and process CPU time (what this process did, not how long it waited for a core).
    entry["ratio_fastest_step"] = entry["hf"]["min_step_time_s"] / entry["ours"]["min_step_time_s"]
    entry["ratio_cpu_time"] = entry["hf"]["median_cpu_time_s"] / entry["ours"]["median_cpu_time_s"]
    entry["target_met"] = entry["ratio"] >= TARGET_MIN_RATIO
    entry["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses["ours"], losses["hf"]))
    return entry


def check_first_losses(setting: str, ours: float, hf: float) -> None:
    """Print the first-step losses; raise if they differ (the two sides would not be comparable)."""
    difference = abs(ours - hf)
    tqdm.write(f"[{setting}] first-step loss: ours {ours:.6f}, hf {hf:.6f}, |difference| {difference:.2e}")
    if difference > LOSS_TOLERANCE:
        raise RuntimeError(
            f"[{setting}] first-step losses differ by {difference:.2e} > {LOSS_TOLERANCE:g}: the two sides do not "
            "compute the same objective on the same weights"
        )


def run_benchmark(args: argparse.Namespace) -> dict:
    """Measure every setting; returns ``{"config": ..., "results": [one dict per setting]}``."""
    n_steps = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        checkpoint_dir = Path(tmp) / "checkpoint"
        vocab_size = write_checkpoint(args.model, args.seed, checkpoint_dir)
        batches = make_batches(n_steps, args.batch_size, args.seq_len, vocab_size, args.seed)
        total = len(args.settings) * n_steps * len(SIDES)
        with tqdm(total=total, desc="bench_train", unit="step", file=sys.stderr) as bar:
            results = [run_setting(args, setting, checkpoint_dir, batches, bar) for setting in args.settings]
    return {
        "config": {
            "model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": "float32",
            "device": "cpu", "steps": args.steps, "warmup_steps": args.warmup, "seed": args.seed,
            "optimizer": {"name": "torch.optim.AdamW", **ADAMW_KWARGS}, "hf_attn_implementation": "sdpa",
            "hf_activation_checkpointing_kwargs": {"use_reentrant": False},
            "order": "per step index, alternating: ours then hf, hf then ours, ...",
            "target_min_ratio": TARGET_MIN_RATIO, "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.machine(),
        },
        "results": results,
    }


def format_table(report: dict) -> str:
    """The results as a fixed-width text table (ratios are ours / HF in speed: above 1 means ours is faster)."""
    header = (f"{'AC':5} {'ours s/step':>11} {'HF s/step':>10} {'ours tok/s':>10} {'HF tok/s':>9} "
              f"{'ours/HF':>8} {'target':>7} {'fastest':>8} {'CPU time':>9} {'max |dloss|':>11}")
    lines = [header, "-" * len(header)]
    for r in report["results"]:
        lines.append(
            f"{r['setting']:5} {r['ours']['median_step_time_s']:11.2f} {r['hf']['median_step_time_s']:10.2f} "
            f"{r['ours']['tokens_per_second']:10.0f} {r['hf']['tokens_per_second']:9.0f} {r['ratio']:8.3f} "
            f"{'met' if r['target_met'] else 'MISSED':>7} {r['ratio_fastest_step']:8.3f} {r['ratio_cpu_time']:9.3f} "
            f"{r['max_loss_difference']:11.1e}"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    """Save a grouped bar chart of tokens/s (ours vs HF per AC setting) to ``path``."""
    plt = pyplot()

    results = report["results"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    width = 0.38
    for offset, side, label, color in ((-width / 2, "ours", "torchtune_ac recipe step", "tab:blue"),
                                       (width / 2, "hf", "HF LlamaForCausalLM loop", "tab:gray")):
        xs = [i + offset for i in range(len(results))]
        values = [r[side]["tokens_per_second"] for r in results]
        ax.bar(xs, values, width, label=label, color=color)
        for x, v in zip(xs, values):
            ax.annotate(f"{v:,.0f}", (x, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
    ax.set_xticks(range(len(results)), [f"AC {r['setting']}\nours/HF = {r['ratio']:.3f}" for r in results])
    ax.set_ylabel("tokens / s (median step)")
    cfg = report["config"]
    ax.set_title(f"Training step on {cfg['model']}: batch {cfg['batch_size']} x {cfg['seq_len']} tokens, fp32, "
                 f"{cfg['threads']} CPU threads", fontsize=9)
    ax.set_ylim(0, 1.3 * max(r[s]["tokens_per_second"] for r in results for s in SIDES))
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    save_figure(fig, path)


# Dense bf16 peak FLOP/s by device name (NVIDIA's data sheets, without sparsity).
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 80GB HBM3": 989.0, "H100 PCIe": 756.0, "H100 NVL": 835.0,
                    "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "RTX 4090": 165.0, "A10": 125.0}
PLAN_TARGET = 0.15
MFU_TARGET = 0.40
# The device of ``--device cuda`` (a test stands the CPU in, with torch.cuda's counters stubbed, to run its calls).
CUDA_DEVICE = torch.device("cuda")


def device_peak_tflops(name: str, given: Optional[float]) -> float:
    if given is not None:
        return given
    for key, value in BF16_PEAK_TFLOPS.items():
        if key in name:
            return value
    raise SystemExit(f"bench_train: no known bf16 peak for {name!r}; pass --peak-tflops")


def step_model_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, whole_rows: bool = False) -> float:
    """Training FLOPs of one step on ``batch``: 6 per parameter per token (forward and backward), and attention's
    scores and weighted sum per document (``_profile_step.attention_flops``: causal masking not subtracted, as
    PaLM's MFU counts it). A packed row's documents attend only within themselves: documents of lengths L_i do
    ``sum(L_i^2)``, not ``row_len^2``. ``whole_rows``: the count before 2026-11-29, attention over every whole row
    (what the 2026-11-27 H100 figures counted)."""
    n_params = sum(p.numel() for p in model.parameters())
    counted = {"tokens": batch["tokens"]} if whole_rows else batch
    return 6 * n_params * batch["tokens"].numel() + attention_flops(model, counted)


def packed_batches(n: int, batch_size: int, seq_len: int, vocab_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` packed batches as the collate code makes them: each row a run of documents of random lengths (64 to
    ``seq_len / 2`` tokens, the last cut to fill the row), labels shifted within each document, the host-side
    counts included."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        samples = []
        for _ in range(batch_size):
            tokens, labels, ids = [], [], []
            while len(tokens) < seq_len:
                length = min(int(torch.randint(64, max(65, seq_len // 2), (1,), generator=generator)),
                             seq_len - len(tokens))
                doc = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
                tokens += doc
                labels += doc[1:] + [IGNORE_INDEX]
                ids += [len(set(ids))] * length
            samples.append({"tokens": tokens, "labels": labels, "document_ids": ids})
        out.append(collate_batch(samples, pad_id=0))
    return out


class RecompileCounter(logging.Handler):
    """Counts Dynamo's "Recompiling function" records (``torch._logging.set_logs(recompiles=True)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("Recompiling function"):
            self.count += 1


def count_host_syncs(step: Callable[[], object]) -> int:
    """Synchronisations of the host with the GPU during ``step()``: torch warns at each one in sync debug mode."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing" in str(w.message) for w in caught)


def run_cuda_setting(args: argparse.Namespace, setting: str) -> dict:
    """The recipe's build and step on one GPU for one AC setting: throughput, MFU, memory against the plan,
    recompiles and host synchronisations per step."""
    from torchtune_ac.memory.planner import Workload, estimate_memory
    from torchtune_ac.runtime.process_memory import fixed_bytes

    device = CUDA_DEVICE
    dtype = DType.BF16 if args.dtype == "bf16" else DType.FP32
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    fixed = fixed_bytes(device)
    # What of it the caching allocator holds (a later setting's fixed cost was 2 GiB above the first's on an H100:
    # these tell whether tensors of the one before outlived it or the memory is outside the allocator).
    start_allocated, start_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    ctx = DistributedContext(rank=0, world_size=1, local_rank=0, device=device)
    component = Component(key="model", path=f"torchtune_ac.models.{args.model}")
    plan = resolve_memory_plan(ACConfig(ac_mode=ACMode(setting)), MemoryConfig(), build_meta_model(component),
                               clip_grad_norm=None, dtype=dtype.torch, device="cuda")
    start = time.perf_counter()
    model = build_training(build_meta_model(component),
                           AssemblyPlan(dtype=dtype, memory=plan, compile=args.compile,
                                        seed=args.seed), ctx=ctx).model
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start  # meta build, AC, compile wrappers, allocation, random initialisation
    make_optimizer = Component(key="optimizer", path="torch.optim.AdamW",
                               kwargs={**ADAMW_KWARGS, "fused": True}).instantiate
    stepper = plan.build_stepper(make_optimizer, model)
    n = args.warmup + args.steps
    if args.packed:
        batches = packed_batches(n, args.batch_size, args.seq_len, model.args.vocab_size, args.seed)
    else:
        batches = [{"tokens": t, "labels": shift_labels(t)}
                   for t in make_batches(n, args.batch_size, args.seq_len, model.args.vocab_size, args.seed)]
    micro = [[move_batch(batch, device)] for batch in batches]  # the host-side counts stay on the host
    recompiles = RecompileCounter()
    logging.getLogger("torch._dynamo").addHandler(recompiles)  # torch._logging stops propagation there
    torch._logging.set_logs(recompiles=True)
    times, losses = [], []
    try:
        for i, batch in enumerate(micro):
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses.append(train_step(model, stepper, batch, ctx=ctx, objective=plan.objective(compiled=args.compile)).loss)
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        syncs = count_host_syncs(lambda: train_step(model, stepper, micro[-1], ctx=ctx, objective=plan.objective(compiled=args.compile)))
    finally:
        torch._logging.set_logs()
        logging.getLogger("torch._dynamo").removeHandler(recompiles)
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    timed = batches[args.warmup:]
    flops = statistics.mean(step_model_flops(model, batch) for batch in timed)
    flops_whole_rows = statistics.mean(step_model_flops(model, batch, whole_rows=True) for batch in timed)
    del model, stepper, micro

    varlen = args.packed and dtype is DType.BF16
    workload = Workload(args.batch_size, args.seq_len, dtype=dtype, varlen=varlen,
                        blas_workspaces=cublas_workspace_bytes(device)[0], compiled=args.compile,
                        cuda=True).with_settings(plan.settings)
    (estimate,) = estimate_memory(component.instantiate, make_optimizer, workload, [plan.ac])
    tokens = args.batch_size * args.seq_len
    median = statistics.median(times)
    peak = device_peak_tflops(torch.cuda.get_device_name(), args.peak_tflops) * 1e12
    planned = estimate.total + fixed
    return {"setting": setting, "plan": str(plan.ac), "packed": args.packed, "build_s": build_s,
            "median_step_time_s": median, "step_times_s": times,
            "tokens_per_second": tokens / median, "mfu": flops / median / peak,
            "mfu_whole_rows": flops_whole_rows / median / peak,
            "recompiles": recompiles.count, "host_syncs_per_step": syncs,
            "losses": losses, "peak_allocated_gib": allocated / 2**30, "peak_reserved_gib": reserved / 2**30,
            "fixed_gib": fixed / 2**30, "fixed_allocated_gib": start_allocated / 2**30,
            "fixed_reserved_gib": start_reserved / 2**30, "planned_step_gib": estimate.total / 2**30, "planned_gib": planned / 2**30,
            "planned_over_reserved": planned / (reserved + fixed),
            "planned_over_allocated": planned / (allocated + fixed)}


def run_cuda_benchmark(args: argparse.Namespace) -> dict:
    results = [run_cuda_setting(args, setting) for setting in tqdm(args.settings, desc="bench_train cuda",
                                                                   file=sys.stderr)]
    props = torch.cuda.get_device_properties(0)
    return {"config": {"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                       "dtype": args.dtype, "compile": args.compile, "packed": args.packed,
                       "device": torch.cuda.get_device_name(),
                       "device_memory_gib": props.total_memory / 2**30, "cuda": torch.version.cuda,
                       "peak_tflops": device_peak_tflops(torch.cuda.get_device_name(), args.peak_tflops),
                       "steps": args.steps, "warmup_steps": args.warmup, "torch": torch.__version__,
                       "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
                       "optimizer": {"name": "torch.optim.AdamW", **ADAMW_KWARGS, "fused": True},
                       "targets": {"mfu": MFU_TARGET, "plan_within": PLAN_TARGET}},
            "results": results}


def format_cuda_table(report: dict) -> str:
    cfg = report["config"]
    lines = [f"{cfg['model']} on {cfg['device']}, batch {cfg['batch_size']} x {cfg['seq_len']}"
             f"{' packed' if cfg['packed'] else ''}, {cfg['dtype']}, compile {cfg['compile']}",
             f"{'AC':5} {'s/step':>7} {'tok/s':>9} {'MFU':>6} {'alloc GiB':>9} {'resv GiB':>9} {'fixed':>6} "
             f"{'plan GiB':>8} {'plan/(resv+fixed)':>17} {'recompiles':>10} {'syncs/step':>10} {'build s':>7}"]
    for r in report["results"]:
        lines.append(f"{r['setting']:5} {r['median_step_time_s']:7.3f} {r['tokens_per_second']:9.0f} "
                     f"{r['mfu']:6.1%} {r['peak_allocated_gib']:9.2f} {r['peak_reserved_gib']:9.2f} "
                     f"{r['fixed_gib']:6.2f} {r['planned_gib']:8.2f} {r['planned_over_reserved']:17.2f} "
                     f"{r['recompiles']:10d} {r['host_syncs_per_step']:10d} {r['build_s']:7.1f}")
    return "\n".join(lines)


def run_against(args: argparse.Namespace) -> None:
    """``--against REV``: the working tree against ``REV``, interleaved A B B A (see ``scripts/bench/_against.py``)."""
    import _against

    # --quick: 10 steps per run (the first 2 untimed); otherwise 25 (3 untimed).
    steps, warmup = (10, 2) if args.quick else (25, 3)
    overrides = [f"ac_mode={args.ac}", *args.set]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    report = _against.compare(args.against, overrides=overrides, overrides_a=args.set_a, steps=steps, warmup=warmup,
                              rounds=args.rounds, seed=args.seed,
                              progress=lambda text: print(text, file=sys.stderr, flush=True))
    report["config"] = {
        "command": "scripts/bench/bench_train.py " + " ".join(sys.argv[1:]), "date": started,
        "workload": {"model": _against.WORKLOAD_ARGS, "batch_size": _against.BATCH_SIZE,
                     "seq_len": _against.SEQ_LEN, "packed": True, "dtype": "fp32", "optimizer": "torch.optim.AdamW"},
        "overrides": overrides, "overrides_a": args.set_a, "steps_per_run": steps, "untimed_steps_per_run": warmup,
        "order": "one step at a time, A B B A A B ...; pairs of processes started A first, then B first",
        "rounds": args.rounds, "torch": torch.__version__, "machine": platform.machine(),
        "cpu": _cpu_name(), "cpus": os.cpu_count(), "uptime": _uptime(),
    }
    out_json = args.out_json if args.out_json != DEFAULT_JSON else REPO / "bench_results" / "bench_train_against.json"
    write_report(report, _against.format_report(report), out_json,
                 lambda report, path: _against.plot([(f"working tree against {args.against}", report)], path),
                 args.out_png or out_json.with_suffix(".png"))


def redraw_against(args: argparse.Namespace) -> None:
    """``--redraw``: the charts of saved ``--against`` reports, side by side."""
    import _against

    panels = []
    for path in args.redraw:
        try:
            panels.append((path.stem, json.loads(path.read_text())))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SystemExit(f"bench_train --redraw: {path}: not a JSON report ({error})")
        if "pairs" not in panels[-1][1]:
            raise SystemExit(f"bench_train --redraw: {path}: not a report of --against (it has no 'pairs')")
    _against.plot(panels, args.out_png)
    print(f"wrote {args.out_png}")


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                    platform.processor())


def _uptime() -> str:
    """``uptime``'s line (with the load averages), when this machine has the command."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def run_profile(args: argparse.Namespace) -> None:
    """``--profile``: one step's time by share, and its MFU (see ``scripts/bench/_profile_step.py``)."""
    import _against
    import _profile_step

    overrides = [f"ac_mode={args.ac}", *args.set]
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    with tempfile.TemporaryDirectory(prefix="bench_train_profile_") as tmp:
        config = _against.write_workload(Path(tmp), args.seed)
        report = _profile_step.profile_workload(config, [f"output_dir={tmp}/run", *overrides], warmup=args.warmup + 1,
                                                steps=args.steps)
    report["config"] = {"command": "scripts/bench/bench_train.py " + " ".join(sys.argv[1:]), "date": started,
                        "revision": _against.describe_working_tree(), "overrides": overrides,
                        "torch": torch.__version__, "cpu": _cpu_name(), "cpus": os.cpu_count(), "uptime": _uptime()}
    out_json = args.out_json if args.out_json != DEFAULT_JSON else REPO / "bench_results" / "bench_train_profile.json"
    write_report(report, _profile_step.format_profile(report), out_json)


def main(argv: Optional[list[str]] = None) -> None:
    use_expandable_segments_by_default()  # as `tune run` does, before CUDA's allocator is first used
    filter_known_noise()
    args = parse_args(argv)
    if args.redraw is not None:
        redraw_against(args)
        return
    if args.against is not None:
        run_against(args)  # its `tune run` processes take their own threads, each side as its revision does
        return
    set_thread_defaults()  # the threads `tune run` would take (torch is imported: not the spin count)
    if args.profile:
        run_profile(args)
        return
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_train --device cuda: no CUDA device")
        report = run_cuda_benchmark(args)
        write_report(report, format_cuda_table(report), args.out_json)
        return
    report = run_benchmark(args)
    write_report(report, format_table(report), args.out_json, plot,
                 args.out_png or REPO / "docs" / "images" / "bench_train.png")


if __name__ == "__main__":
    main()
