"""``bench_train.py --profile``: where one CPU training step of ``--against``'s workload spends its time, and its MFU.

The run is the recipe's own (``run/setup.py``'s ``setup_training``: the config, the model, the memory plan, the data,
all as ``tune run`` builds them); its steps are ``train_step`` on the recipe's batches. After warm-up steps:

  * the matmul peak: the best of several ``torch.mm`` of two 4096 x 4096 fp32 matrices, on this process's threads,
    measured between the steps (what a dense fp32 kernel reaches on this machine, in the same conditions);
  * the step's FLOPs: matrix multiplies counted by ``FlopCounterMode`` on one step, plus attention, which torch's
    counter does not know on a CPU, counted per document: ``12 x layers x heads x head_dim x sum(length^2)`` (forward
    and backward, causal masking not subtracted, as PaLM's MFU counts it); MFU is FLOPs / median step time / peak;
  * the profile: ``torch.profiler`` over ``--profile-steps`` steps; every aten op's own time (self CPU time, nested
    ops not counted twice) is put in one share (matrix multiplies, attention, norms and elementwise work, copies and
    layout, the loss, the optimizer, allocation), and what the steps' wall time has beyond the ops is Python and
    dispatch overhead. The kernel's time (page faults, ``mmap``) is the steps' system CPU time, reported beside it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

PEAK_SIZE = 4096
PEAK_REPEATS = 5

# Op name fragments per share, tried in this order (the first that matches wins); an op under the optimizer's
# step is the optimizer's whatever it is.
CATEGORIES = (
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("loss", ("log_softmax", "nll_loss", "cross_entropy")),
    ("matrix multiplies", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear")),
    ("allocation", ("aten::empty", "aten::empty_strided", "aten::resize_")),
    ("copies and layout", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::split",
                           "aten::narrow", "aten::slice", "aten::_to_copy", "aten::index", "aten::transpose",
                           "aten::view", "aten::reshape", "aten::unsqueeze", "aten::squeeze", "aten::expand",
                           "aten::as_strided", "aten::t", "aten::permute", "aten::unbind", "aten::stack",
                           "aten::_reshape_alias", "aten::detach", "aten::alias", "aten::select")),
)
ELEMENTWISE = "norms and elementwise"
OPTIMIZER = "optimizer"
OVERHEAD = "Python and dispatch (outside ops)"


def categorise(name: str, under_optimizer: bool) -> str:
    if under_optimizer:
        return OPTIMIZER
    for category, fragments in CATEGORIES:
        if any(name == f or name.startswith(f + "_") or (not f.startswith("aten::") and f in name)
               for f in fragments):
            return category
    return ELEMENTWISE


def matmul_peak_flops(threads: int) -> float:
    """FLOP/s of the best of ``PEAK_REPEATS`` fp32 ``torch.mm`` of ``PEAK_SIZE``-square matrices."""
    a = torch.randn(PEAK_SIZE, PEAK_SIZE)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE)
    torch.mm(a, b)  # warm-up
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(PEAK_REPEATS))
    return 2 * PEAK_SIZE**3 / best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def attention_flops(model: torch.nn.Module, batch: dict) -> float:
    """Attention's forward + backward FLOPs for a packed ``batch``: per document of length L, per layer and head,
    ``QK^T`` and ``PV`` (``2 x 2 x L^2 x head_dim`` forward, twice that backward)."""
    args = model.args
    lengths = batch.get("document_lengths")
    if lengths is None:
        lengths = torch.full((batch["tokens"].shape[0],), batch["tokens"].shape[1])
    squares = float((lengths.double() ** 2).sum())
    return 12 * args.n_layers * args.n_heads * args.resolved_head_dim * squares


def _under_optimizer(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return True
        parent = parent.cpu_parent
    return False


def profile_workload(config: Path, overrides: Sequence[str], *, warmup: int, steps: int) -> dict:
    """Set the recipe up on ``config`` and measure its steps (see the module docstring)."""
    from torchtune_ac import cli
    from torchtune_ac.registry import find_recipe

    from torchtune_ac.run.session import open_run
    from torchtune_ac.run.setup import setup_training

    recipe_module = cli.load_recipe(find_recipe("full_finetune").path)
    cfg = cli.load_recipe_config(recipe_module, str(config), list(overrides), [], to_run=True)
    with open_run(cfg) as run:
        trainer = setup_training(run)
        report = _profile_steps(cfg, trainer.training, run.ctx, trainer.data.loader, warmup=warmup, steps=steps)
        run.close(succeeded=True)
    return report


def _profile_steps(cfg, training, ctx, loader, *, warmup: int, steps: int) -> dict:
    import resource

    from torchtune_ac.training.step import move_batch, train_step

    batches = iter(loader)
    needed = warmup + 2 + 2 * steps
    if len(loader) < needed:
        raise SystemExit(f"bench_train --profile: {needed} batches needed, the data has {len(loader)}")

    def step(batch: dict) -> float:
        return _timed(lambda: train_step(training.model, training.stepper, [move_batch(batch, ctx.device)], ctx=ctx,
                                         objective=training.objective, clip_grad_norm=cfg.clip_grad_norm))

    for _ in range(warmup):
        step(next(batches))
    peak_before = matmul_peak_flops(torch.get_num_threads())
    timed_batches = [next(batches) for _ in range(steps)]
    times = [step(batch) for batch in timed_batches]
    peak_after = matmul_peak_flops(torch.get_num_threads())
    # FLOPs of a step: matrix multiplies as executed (counted on one more step: their count does not depend on
    # the batch's documents), attention per document of that step's batch.
    counter = FlopCounterMode(display=False)
    flop_batch = next(batches)
    with counter:
        step(flop_batch)
    matmul_flops = counter.get_total_flops()
    attention = attention_flops(training.model, flop_batch)
    tokens = flop_batch["tokens"].numel()
    n_params = sum(p.numel() for p in training.model.parameters())

    profiled_batches = [next(batches) for _ in range(steps)]
    usage_before = resource.getrusage(resource.RUSAGE_SELF)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(step(batch) for batch in profiled_batches)
    usage_after = resource.getrusage(resource.RUSAGE_SELF)
    shares: dict[str, float] = {}
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue  # ranges (autograd's nodes, the optimizer's step): their own time is Python, counted below
        category = categorise(event.name, _under_optimizer(event))
        shares[category] = shares.get(category, 0.0) + event.self_cpu_time_total / 1e6
    shares[OVERHEAD] = max(wall - sum(shares.values()), 0.0)
    profiled_attention = sum(attention_flops(training.model, b) for b in profiled_batches)

    peak = max(peak_before, peak_after)
    median = statistics.median(times)
    model_flops = matmul_flops + attention
    return {
        "parameters": n_params,
        "tokens_per_step": tokens,
        "threads": torch.get_num_threads(),
        "step_times_s": times,
        "median_step_time_s": median,
        "matmul_peak_gflops": {"before": peak_before / 1e9, "after": peak_after / 1e9, "used": peak / 1e9},
        "flops_per_step": {"matmul_counted": matmul_flops, "attention": attention, "model": model_flops,
                           "six_n_tokens": 6 * n_params * tokens},
        "mfu": model_flops / median / peak,
        "mfu_six_n": (6 * n_params * tokens + attention) / median / peak,
        "profile": {"steps": steps, "wall_s": wall, "shares_s": shares,
                    "system_cpu_s": usage_after.ru_stime - usage_before.ru_stime,
                    "user_cpu_s": usage_after.ru_utime - usage_before.ru_utime,
                    "attention_flops": profiled_attention},
        "top_ops": [{"name": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
                    for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]],
    }


def format_profile(report: dict) -> str:
    p = report["profile"]
    total = p["wall_s"]
    lines = [f"one step of {report['tokens_per_step']} tokens, {report['parameters']:,} parameters, "
             f"{report['threads']} threads: median {report['median_step_time_s']:.3f} s",
             f"{'share':<36} {'s/step':>7} {'of the step':>11}"]
    for name, seconds in sorted(p["shares_s"].items(), key=lambda item: -item[1]):
        lines.append(f"{name:<36} {seconds / p['steps']:>7.3f} {seconds / total:>10.1%}")
    lines.append(f"{'(in the kernel: page faults, mmap)':<36} {p['system_cpu_s'] / p['steps']:>7.3f}   system CPU "
                 f"time, of {(p['system_cpu_s'] + p['user_cpu_s']) / p['steps']:.3f} s CPU time per step")
    peak = report["matmul_peak_gflops"]
    flops = report["flops_per_step"]
    lines.append(f"matmul peak {peak['used']:.1f} GFLOP/s (fp32 {PEAK_SIZE}^3 mm: {peak['before']:.1f} before the "
                 f"steps, {peak['after']:.1f} after); step {flops['model'] / 1e9:.1f} GFLOP (matmuls "
                 f"{flops['matmul_counted'] / 1e9:.1f}, attention {flops['attention'] / 1e9:.2f}; 6N x tokens "
                 f"{flops['six_n_tokens'] / 1e9:.1f}): MFU {report['mfu']:.1%} ({report['mfu_six_n']:.1%} with 6N)")
    return "\n".join(lines)
