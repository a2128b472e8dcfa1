"""``bench_plan.py --runs``: ``tune plan`` against whole ``tune run`` processes on a CPU, with and without a budget.

For each workload (a model, packed rows of the embedded data, fp32, AdamW; ``_against.write_workload``'s files) and
budget, three fresh processes:

  * ``tune plan --budget-gib B``: the row ``ac_mode: auto`` picks, and its device figure (the step, the process's
    resident set before the model and what a stepping CPU process adds);
  * ``tune run`` with ``ac_mode: auto`` and ``ac_memory_budget_gib: B``: its own estimate (it measures its own fixed
    cost) and its peak resident set (``wait4``'s ``ru_maxrss``, what a container's limit sees). With a budget on a
    CPU, glibc maps each tensor on its own, so that the resident set follows the tensors as the plan counts them;
  * ``tune run`` with the AC setting auto picked, and no budget: glibc's allocator left alone (the default, faster
    step): its peak resident set.

Targets (the issue's): with a budget, the peak within the budget and the estimate within 0.85x-1.3x of it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# (label, overrides of the workload, budgets in GiB, processes). llama_small at 2 x 1024 with 1.25 GiB is the
# speed issue's case; under tensor parallelism (2 processes, one group) the plan's split of each part is checked
# against each process's peak (the largest of the launcher's children).
SMALL = ("model._component_=torchtune_ac.models.llama_small", "checkpoint_dir=null", "max_seq_len=1024",
         "batch_size=2")
RUNS = (
    ("llama_small, packed 2 x 1024", SMALL, (1.25, 1.40, 1.70), 1),
    ("llama_small_32k, packed 2 x 1024", ("model._component_=torchtune_ac.models.llama_small_32k",
                                          "checkpoint_dir=null", "max_seq_len=1024", "batch_size=2"), (1.30,), 1),
    ("6.6 M GQA Llama, packed 4 x 512", (), (1.0,), 1),
    ("llama_small, TP 2, packed 2 x 1024", (*SMALL, "tensor_parallel_dim=2"), (0.80, 0.95, 1.10), 2),
)
STEPS = 8
# "per-op" in a plan's row is ac_mode: selective, ac_option: op; "every 2nd block" is ac_option: 2.
SETTINGS = {"none": ("ac_mode=none",), "per-op": ("ac_mode=selective", "ac_option=op"),
            "full": ("ac_mode=full",)}
PICKED = re.compile(r"^(?P<setting>.+?) +(?:[-\d.]+ +){7}(?P<device>[\d.]+) .*<- ac_mode: auto picks this", re.M)
CHOSE = re.compile(r"auto -> .*?estimated (?P<estimate>[\d.]+) GiB of")


def _tune(argv: list[str], cwd: Path) -> tuple[str, str, int]:
    """``tune ARGV`` in a fresh process: its stdout, stderr and peak resident set in bytes."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen([sys.executable, "-m", "torchtune_ac.cli", *argv], cwd=cwd, env=env, stdout=out,
                                   stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise RuntimeError(f"tune {' '.join(argv)} exited {process.returncode}:\n{stderr[-3000:]}")
    return stdout, stderr, usage.ru_maxrss * 1024


def _setting_overrides(setting: str) -> tuple[str, ...]:
    if setting in SETTINGS:
        return SETTINGS[setting]
    stride = re.match(r"every (\d+)", setting)[1]
    return ("ac_mode=selective", f"ac_option={stride}")


def run_plan_vs_runs(seed: int, progress=lambda text: None) -> list[dict]:
    import _against

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_plan_runs_") as tmp:
        scratch = Path(tmp)
        config = str(_against.write_workload(scratch, seed))
        for label, overrides, budgets, nproc in RUNS:
            for budget in budgets:
                progress(f"{label}, budget {budget:g} GiB")
                common = ["--config", config, *overrides]
                plan_out, _, _ = _tune(["plan", *common, "--nproc", str(nproc), "--budget-gib", str(budget)], scratch)
                picked = PICKED.search(plan_out)
                if picked is None:
                    raise RuntimeError(f"tune plan picked no row:\n{plan_out}")
                # tune plan prints GiB, or MiB for a small model (its header says which).
                per_gib = 1024 if re.search(r"^estimated MiB per process", plan_out, re.M) else 1
                setting, planned = picked["setting"].strip(), float(picked["device"]) / per_gib
                run = ["run", *(("--nproc_per_node", str(nproc)) if nproc > 1 else ()), "full_finetune", *common,
                       f"max_steps_per_epoch={STEPS}"]
                _, err, with_budget = _tune([*run, f"output_dir={scratch}/budget", "ac_mode=auto",
                                             f"ac_memory_budget_gib={budget}"], scratch)
                estimate = float(CHOSE.search(err)["estimate"])
                _, _, without = _tune([*run, f"output_dir={scratch}/plain", *_setting_overrides(setting)], scratch)
                for name in ("budget", "plain"):
                    subprocess.run(["rm", "-rf", str(scratch / name)], check=True)
                rows.append({"workload": label, "processes": nproc, "budget_gib": budget, "setting": setting,
                             "planned_gib": planned,
                             "run_estimate_gib": estimate, "peak_with_budget_gib": with_budget / 2**30,
                             "peak_without_budget_gib": without / 2**30})
    for row in rows:
        row["estimate_over_peak_with_budget"] = row["run_estimate_gib"] / row["peak_with_budget_gib"]
        row["estimate_over_peak_without_budget"] = row["run_estimate_gib"] / row["peak_without_budget_gib"]
        row["within_budget"] = row["peak_with_budget_gib"] <= row["budget_gib"]
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'workload':<36} {'budget':>6} {'auto picks':<16} {'tune plan':>9} {'run est.':>8} "
             f"{'peak, budget':>12} {'est./peak':>9} {'peak, none':>10} {'est./peak':>9}"]
    for r in rows:
        lines.append(f"{r['workload']:<36} {r['budget_gib']:>6.2f} {r['setting']:<16} {r['planned_gib']:>9.2f} "
                     f"{r['run_estimate_gib']:>8.2f} {r['peak_with_budget_gib']:>12.2f} "
                     f"{r['estimate_over_peak_with_budget']:>9.2f} {r['peak_without_budget_gib']:>10.2f} "
                     f"{r['estimate_over_peak_without_budget']:>9.2f}")
    met = all(r["within_budget"] and 0.85 <= r["estimate_over_peak_with_budget"] <= 1.3 for r in rows)
    lines.append("GiB; targets with a budget (the peak within it, the estimate within 0.85x-1.3x of the peak): "
                 + ("all met" if met else "NOT all met"))
    return "\n".join(lines)
