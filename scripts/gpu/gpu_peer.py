"""Llama 3 8B on one GPU, this project against torchtune 0.6.1 on the same GPU, shape and settings, in one run.

    python scripts/gpu/gpu_peer.py --out DIR                       # the GPU check's llama8b stage: ours, torchtune
    python scripts/gpu/gpu_peer.py --out DIR --rounds 2            # --full: ours, torchtune, torchtune, ours
    python scripts/gpu/gpu_peer.py --out DIR --model tiny --device cpu --steps 2 --warmup 1   # the plumbing on a CPU

Both sides train the same random-init Llama 3 8B (written once as a Hugging Face checkpoint that both load), on the
same documents (random words, each longer than a row), unpacked rows of ``--seq-len`` tokens, batch ``--batch-size``,
bf16, no gradient accumulation, torchao's 8-bit AdamW stepped in backward (no clipping: torchtune refuses it with
the step in backward), full activation checkpointing, the chunked cross-entropy (8 chunks on both), eager (``--compile``
for both). Each side is a fresh process, one after the other, alternating (``--rounds``), so that neither always
runs first on a cold GPU.

* ours: ``tune run full_finetune --config llama3/8B_full_single_device`` with those overrides. Its figures are
  ``metrics.jsonl``'s (``tokens_per_second``, ``peak_memory_gib`` allocated, ``peak_memory_reserved_gib``), with
  ``tune plan``'s estimate of the step and the MFU (``bench_train.py``'s count: 6 FLOP per parameter and token
  and attention over the whole row, recomputation left out, against the device's dense bf16 peak).
* torchtune: its ``full_finetune_single_device`` recipe through its Python API (``FullFinetuneRecipeSingleDevice``:
  ``setup``, ``train``, ``cleanup``, as its ``recipe_main`` calls them), with its config
  ``llama3/8B_full_single_device`` and overrides to the same settings. Its end-of-epoch save (16 GB here) is replaced
  by nothing, as ours saves nothing. The tokenizer is a byte-level tiktoken file (256 tokens, Llama 3's special
  tokens), since no Llama 3 tokenizer can be downloaded: rows are ``--seq-len`` tokens on both sides all the same.
  Its figures are its ``DiskLogger`` lines (``tokens_per_second_per_gpu``, ``peak_memory_alloc``,
  ``peak_memory_reserved``).

The first ``--warmup`` steps of each run are left out of its means. A side that cannot run (torchtune not
importable, the plan larger than the GPU) is recorded with the reason, not run. Writes ``DIR/gpu_peer.json``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GiB = 2**30
# A small model of Llama 3's vocabulary (torchtune's tokenizer puts its special tokens at 128000-128255).
TINY = dict(vocab_size=128_256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_dim=128, max_seq_len=512,
            rope_theta=500_000.0)
WORDS = ["alpha", "river", "stone", "quietly", "seven", "window", "orange", "market", "under", "silver"]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_peer.json")
    parser.add_argument("--sides", default="ours,torchtune", help="comma-separated: ours, torchtune")
    parser.add_argument("--rounds", type=int, default=1, help="A B blocks, the next one B A (default 1)")
    parser.add_argument("--model", choices=("llama3_8b", "tiny"), default="llama3_8b")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of its means")
    parser.add_argument("--compile", action="store_true", help="compile on both sides")
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: from its name)")
    parser.add_argument("--torchtune-side", type=Path, help=argparse.SUPPRESS)  # internal: run torchtune's side
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------------------------ shared inputs

def write_inputs(args: argparse.Namespace, work: Path) -> dict:
    """The checkpoint (random weights from seed 0, Hugging Face format, our embedded tokenizer beside it), the
    documents (one file per side's reader) and torchtune's byte-level tokenizer file."""
    import torch

    from torchtune_ac.embedded import ensure_embedded_checkpoint
    from torchtune_ac.models import save_hf
    from torchtune_ac.models.families.llama import LLAMA3_8B
    from torchtune_ac.models.llama import Llama, LlamaArgs

    model_args = LLAMA3_8B if args.model == "llama3_8b" else LlamaArgs(**TINY)
    device = torch.device(args.device)
    torch.manual_seed(0)
    with device:
        model = Llama(model_args).to(torch.bfloat16)
    model.init_weights()
    checkpoint = work / "checkpoint"
    save_hf(model, checkpoint, tokenizer_dir=ensure_embedded_checkpoint(), bos_token_id=128_000, eos_token_id=128_001)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    generator = torch.Generator().manual_seed(0)
    words_per_document = max(64, args.seq_len)  # each word is several characters and at least one token
    documents = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (words_per_document,), generator=generator))
                 for _ in range(args.batch_size * args.steps * 2)]
    (work / "documents.txt").write_text("\n\n".join(documents) + "\n")  # ours: blank-line separated
    (work / "documents_lines.txt").write_text("\n".join(documents) + "\n")  # HF datasets' "text": one a line
    # tiktoken's BPE file: each byte its own token, no merges (rank = byte value).
    (work / "tokenizer.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256)))
    return {"layers": model_args.n_layers, "dim": model_args.dim, "vocab_size": model_args.vocab_size,
            "checkpoint_files": sorted(p.name for p in checkpoint.glob("*.safetensors"))}


def common_settings(args: argparse.Namespace) -> dict:
    return {"batch_size": args.batch_size, "seq_len": args.seq_len, "dtype": "bf16",
            "optimizer": "torchao.optim.AdamW8bit",
            "lr": 2e-5, "optimizer_in_bwd": True, "activation_checkpointing": "full", "loss_chunks": 8,
            "compile": args.compile, "steps": args.steps, "warmup": args.warmup}


# -------------------------------------------------------------------------------------------------------- ours

def ours_overrides(args: argparse.Namespace, work: Path, output_dir: Path) -> list[str]:
    return [f"output_dir={output_dir}", f"checkpoint_dir={work / 'checkpoint'}",
            "model._component_=torchtune_ac.models.from_hf_config", f"device={args.device}", "dtype=bf16",
            "dataset._component_=torchtune_ac.data.text_dataset", f"+dataset.source={work / 'documents.txt'}",
            "~dataset.train_on_input", "dataset.packed=false", f"max_seq_len={args.seq_len}",
            f"batch_size={args.batch_size}", "gradient_accumulation_steps=1", "shuffle=false",
            "optimizer._component_=torchao.optim.AdamW8bit", "~optimizer.fused", "optimizer_in_bwd=true",
            "clip_grad_norm=null", "enable_activation_checkpointing=true", "ac_mode=full", "ac_option=null",
            "loss_chunks=8", f"compile={str(args.compile).lower()}", f"max_steps_per_epoch={args.steps}",
            "log_every_n_steps=1", "save_every_n_steps=null", "lr_scheduler=null"]


def plan_ours(overrides: list[str]) -> dict:
    """``tune plan``'s row for our step (full AC), computed as its table computes it, the other rows left out (GiB),
    and the model's training FLOPs per token as ``bench_train.py`` counts them for its MFU (6 per parameter and
    attention over the whole row, PaLM's count; recomputation left out)."""
    import torch

    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    from bench_train import step_model_flops

    from torchtune_ac.cli import load_recipe, load_recipe_config, resolve_recipe_path
    from torchtune_ac.config.meta_model import build_meta_model
    from torchtune_ac.memory.planner import estimate_memory
    from torchtune_ac.run.plan import planner_inputs, process_fixed_bytes, resolve_run_plan

    recipe = load_recipe(resolve_recipe_path("full_finetune"))
    cfg = load_recipe_config(recipe, "llama3/8B_full_single_device", overrides, [])
    model = build_meta_model(cfg.model, cfg.checkpoint_dir)
    plan = resolve_run_plan(cfg, model, world_size=1)
    inputs = planner_inputs(cfg, plan.parallelism, torch.device("cpu"))
    workload = inputs.workload.with_settings(plan.memory.settings, clip_grad_norm=cfg.clip_grad_norm)
    (estimate,) = estimate_memory(inputs.build_model, inputs.make_optimizer, workload, [plan.memory.ac])
    fixed, _ = process_fixed_bytes(cfg.device)
    return {"planned_gib": estimate.total / GiB, "planned_device_gib": (estimate.total + fixed) / GiB,
            # one unpacked row of max_seq_len tokens: its attention is over the whole row
            "flops_per_token": step_model_flops(model, {"tokens": torch.zeros(1, cfg.max_seq_len, dtype=torch.long)},
                                                whole_rows=True) / cfg.max_seq_len}


def run_ours(args: argparse.Namespace, work: Path, index: int) -> dict:
    from torchtune_ac.observability.metrics import read_metrics

    output_dir = work / f"ours_{index}"
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torchtune_ac.cli", "run", "full_finetune", "--config",
                             "llama3/8B_full_single_device", *ours_overrides(args, work, output_dir)],
                            capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        return {"error": f"exit {result.returncode}: {result.stderr[-3000:]}"}
    rows = read_metrics(output_dir)[args.warmup:]
    return {"seconds": round(time.perf_counter() - started, 1),
            "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in rows),
            "step_time_s": statistics.mean(r["step_time_s"] for r in rows),
            "peak_allocated_gib": max(r["peak_memory_gib"] for r in rows),  # on a CPU: the resident set
            **({"peak_reserved_gib": max(r["peak_memory_reserved_gib"] for r in rows)}
               if "peak_memory_reserved_gib" in rows[0] else {}),
            "losses": [r["loss"] for r in read_metrics(output_dir)]}


# ---------------------------------------------------------------------------------------------------- torchtune

def torchtune_overrides(args: argparse.Namespace, work: Path, output_dir: Path, inputs: dict) -> list[str]:
    if args.model == "llama3_8b":
        model = ["model._component_=torchtune.models.llama3.llama3_8b"]
    else:
        model = ["model._component_=torchtune.models.llama3.llama3", f"+model.vocab_size={TINY['vocab_size']}",
                 f"+model.num_layers={TINY['n_layers']}", f"+model.num_heads={TINY['n_heads']}",
                 f"+model.num_kv_heads={TINY['n_kv_heads']}", f"+model.embed_dim={TINY['dim']}",
                 f"+model.max_seq_len={TINY['max_seq_len']}", f"+model.intermediate_dim={TINY['intermediate_dim']}",
                 f"+model.rope_base={int(TINY['rope_theta'])}"]
    files = ",".join(inputs["checkpoint_files"])
    return [*model, f"output_dir={output_dir}", f"tokenizer.path={work / 'tokenizer.model'}",
            f"tokenizer.max_seq_len={args.seq_len}", "dataset._component_=torchtune.datasets.text_completion_dataset",
            "+dataset.source=text", f"+dataset.data_files={work / 'documents_lines.txt'}", "+dataset.column=text",
            "dataset.packed=False", "~dataset.train_on_input", "shuffle=False", "seed=0",
            "checkpointer._component_=torchtune.training.FullModelHFCheckpointer",
            f"checkpointer.checkpoint_dir={work / 'checkpoint'}", f"checkpointer.checkpoint_files=[{files}]",
            f"checkpointer.output_dir={output_dir}", "checkpointer.model_type=LLAMA3",
            f"batch_size={args.batch_size}", "epochs=1", f"max_steps_per_epoch={args.steps}",
            "gradient_accumulation_steps=1", "optimizer._component_=torchao.optim.AdamW8bit", "optimizer.lr=2.0e-5",
            "optimizer_in_bwd=True", "~clip_grad_norm", "enable_activation_checkpointing=True",
            "enable_activation_offloading=False", f"compile={args.compile}", f"device={args.device}", "dtype=bf16",
            "lr_scheduler=null", "log_every_n_steps=1", "log_peak_memory_stats=True",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
            f"metric_logger.log_dir={output_dir / 'logs'}"]


def torchtune_side(spec_path: Path) -> None:
    """In this process: torchtune's recipe, as its ``recipe_main`` runs it, with no end-of-epoch save."""
    import importlib.util

    import torchtune
    import yaml
    from omegaconf import OmegaConf

    spec = json.loads(spec_path.read_text())
    package = Path(torchtune.__file__).resolve().parent.parent / "recipes"
    module_spec = importlib.util.spec_from_file_location("torchtune_full_finetune_single_device",
                                                         package / "full_finetune_single_device.py")
    recipe_module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(recipe_module)
    cfg = OmegaConf.load(package / "configs" / "llama3" / "8B_full_single_device.yaml")
    for override in spec["overrides"]:
        key, value = override.lstrip("+").split("=", 1) if "=" in override else (override, None)
        if key.startswith("~"):
            parent, _, leaf = key[1:].rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if node is not None and leaf in node:
                node.pop(leaf)
            continue
        OmegaConf.update(cfg, key, yaml.safe_load(value), force_add=True)
    recipe = recipe_module.FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    recipe.save_checkpoint = lambda **kwargs: None  # ours saves nothing either
    recipe.train()
    recipe.cleanup()


def read_disk_log(log_dir: Path) -> list[dict]:
    """torchtune's ``DiskLogger`` lines: ``Step 3 | loss:1.2 lr:2e-05 tokens_per_second_per_gpu:123.4 ...``."""
    rows = []
    for path in sorted(log_dir.glob("*.txt")):
        for line in path.read_text().splitlines():
            if not line.startswith("Step "):
                continue
            step, _, fields = line.partition(" | ")
            row = {"step": int(step.split()[1])}
            for field in fields.split():
                key, _, value = field.partition(":")
                try:
                    row[key] = float(value)
                except ValueError:
                    row[key] = value
            rows.append(row)
    return rows


def run_torchtune(args: argparse.Namespace, work: Path, index: int, inputs: dict) -> dict:
    output_dir = work / f"torchtune_{index}"
    spec = work / f"torchtune_{index}.json"
    spec.write_text(json.dumps({"overrides": torchtune_overrides(args, work, output_dir, inputs)}))
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--out", str(output_dir),
                             "--torchtune-side", str(spec)], capture_output=True, text=True, cwd=work)
    if result.returncode != 0:
        return {"error": f"exit {result.returncode}: {result.stderr[-3000:]}"}
    all_rows = read_disk_log(output_dir / "logs")
    rows = all_rows[args.warmup:]
    if not rows:
        return {"error": f"no metrics logged in {output_dir / 'logs'}: {result.stderr[-2000:]}"}
    figures = {"seconds": round(time.perf_counter() - started, 1),
               "tokens_per_second": statistics.mean(r["tokens_per_second_per_gpu"] for r in rows),
               "losses": [r["loss"] for r in all_rows]}
    if "peak_memory_alloc" in rows[0]:
        figures["peak_allocated_gib"] = max(r["peak_memory_alloc"] for r in rows)
        figures["peak_reserved_gib"] = max(r["peak_memory_reserved"] for r in rows)
    return figures


def torchtune_missing() -> Optional[str]:
    try:
        import torchtune  # noqa: F401
        from torchtune import training  # noqa: F401  (what the recipe imports: fails on a torchao it cannot use)
    except Exception as error:  # noqa: BLE001 - recorded as the reason the side did not run
        return f"torchtune does not import: {type(error).__name__}: {error}"[:500]
    return None


# ------------------------------------------------------------------------------------------------------- main

def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    if args.torchtune_side is not None:
        torchtune_side(args.torchtune_side)
        return {}
    import torch

    sides = [s for s in args.sides.split(",") if s]
    unknown = set(sides) - {"ours", "torchtune"}
    if unknown or not sides:
        raise SystemExit(f"gpu_peer: --sides: {','.join(sorted(unknown)) or 'none'}: ours, torchtune")
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "model": args.model, "settings": common_settings(args),
                    "torch": torch.__version__, "runs": [], "not_run": {}}
    try:
        import torchao
        report["torchao"] = torchao.__version__
    except ImportError:
        report["torchao"] = None
    if args.device == "cuda":
        sys.path.insert(0, str(REPO / "scripts" / "bench"))
        from bench_train import device_peak_tflops

        name = torch.cuda.get_device_name()
        report.update(device=name, memory_gib=torch.cuda.get_device_properties(0).total_memory / GiB,
                      peak_tflops=device_peak_tflops(name, args.peak_tflops))
    if "torchtune" in sides and (why := torchtune_missing()) is not None:
        report["not_run"]["torchtune"] = why
        sides.remove("torchtune")
    else:
        import torchtune
        report["torchtune"] = getattr(torchtune, "__version__", "present")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_peer_") as tmp:
        work = Path(tmp)
        inputs = write_inputs(args, work)
        plan = plan_ours(ours_overrides(args, work, work / "plan"))
        report["plan"] = plan
        if args.device == "cuda" and plan["planned_device_gib"] > report["memory_gib"]:
            report["not_run"] = {side: f"the plan ({plan['planned_device_gib']:.1f} GiB) is larger than this GPU "
                                       f"({report['memory_gib']:.1f} GiB)" for side in sides}
            sides = []
        if sides:
            order = [s for r in range(args.rounds) for s in (sides if r % 2 == 0 else sides[::-1])]
            for index, side in enumerate(order):
                try:
                    figures = run_ours(args, work, index) if side == "ours" else run_torchtune(args, work, index, inputs)
                except Exception:  # noqa: BLE001 - recorded; the other side still runs
                    figures = {"error": traceback.format_exc(limit=4)}
                report["runs"].append({"side": side, **figures})
                print(f"gpu_peer: {side}: {json.dumps(figures)[:600]}", flush=True)
    report["summary"] = summarize(report)
    (args.out / "gpu_peer.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))
    return report


def summarize(report: dict) -> dict:
    """Each side's mean tokens/s and largest peaks over its runs, ours against the plan, its MFU, and the ratio."""
    summary: dict = {}
    for side in ("ours", "torchtune"):
        runs = [r for r in report["runs"] if r["side"] == side and "error" not in r]
        if not runs:
            continue
        entry = {"runs": len(runs), "tokens_per_second": statistics.mean(r["tokens_per_second"] for r in runs)}
        for key in ("peak_allocated_gib", "peak_reserved_gib"):
            if all(key in r for r in runs):
                entry[key] = max(r[key] for r in runs)
        summary[side] = entry
    ours, plan = summary.get("ours"), report.get("plan")
    if ours is not None and plan is not None:
        ours["planned_gib"] = plan["planned_gib"]
        if "peak_allocated_gib" in ours:
            ours["plan_over_allocated"] = plan["planned_gib"] / ours["peak_allocated_gib"]
        if report.get("peak_tflops"):
            ours["mfu"] = plan["flops_per_token"] * ours["tokens_per_second"] / (report["peak_tflops"] * 1e12)
    if "ours" in summary and "torchtune" in summary:
        summary["tokens_per_second_ratio"] = (summary["ours"]["tokens_per_second"]
                                              / summary["torchtune"]["tokens_per_second"])
        if "peak_allocated_gib" in summary["ours"] and "peak_allocated_gib" in summary["torchtune"]:
            summary["peak_allocated_ratio"] = (summary["ours"]["peak_allocated_gib"]
                                               / summary["torchtune"]["peak_allocated_gib"])
    return summary


if __name__ == "__main__":
    main()
