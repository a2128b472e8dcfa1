"""Our vision-language step against transformers' Qwen2.5-VL trained by TRL's ``SFTTrainer``, on CPU, side by side.

    python scripts/bench/bench_vlm.py                  # 2 sides x --repeats, a table, bench_results/bench_vlm.{json,png}
    python scripts/bench/bench_vlm.py --short          # the tiny model, a few steps: checks that it runs

Sides, each in a fresh process, interleaved A/B/B/A (each ``--repeats`` adds one such round):

  * ``ours``: our Qwen2.5-VL (``models/vision/qwen2_5_vl.py``) and our step (``training/step.py``'s
    ``accumulate_gradients`` then the stepper's update) on batches our data makes (``data.vision``:
    ``build_vision_dataset`` with ``padding_free`` as the shipped Qwen2.5-VL configs set it, each batch one row of
    documents, ``collate_vision_batch``);
  * ``trl``: transformers' ``Qwen2_5_VLForConditionalGeneration`` of the same shapes (our family's ``config.json``
    for them) trained by TRL 1.16's ``SFTTrainer``, whose collator runs the same processor on the same records.

The sides are made alike: the embedded image-text task (``torchtune_ac/data/embedded/vlm``: 48 conversations, one
56 x 56 image each, 4 image tokens) read in order by both (TRL's sampler sequential), ``--batch-size`` samples a
step, the embedded Qwen2.5-VL processor (14-pixel patches, 2 x 2 merge; our vocabulary of 518 tokens), fp32 on
``--threads`` threads, AdamW from ``torch.optim`` at the same learning rate (ours ``fused``, as the family's
shipped configs set it; TRL's ``adamw_torch``, torch's default: on a CPU one tensor at a time), both towers trained,
no activation checkpointing, no dropout, no gradient clipping (TRL: max_grad_norm 0), no logging, validation or
saving during the steps. Each step's tokens (the batch's attention mask, without padding) are counted by both and checked equal, so
the two sides are known to have trained the same batches. The model (``--size``, default ``bench``: a decoder of
8 blocks of width 512 and a tower of 8 blocks of width 384, about 40 M parameters) is large enough that a step
takes seconds on one thread, not the overhead of a tiny model; the weights differ (each side draws its own
initialisation): the work and the memory do not depend on them. The loss differs in what it covers (ours the
assistant's tokens; TRL's ``SFTTrainer`` every token of a conversational dataset), not in what it computes (the
whole logits on both).

Measured per side: each optimizer step's seconds, leaving out the first ``--warmup-steps`` (the first allocates
AdamW's state and the allocator's pools), ours around the step, TRL's from a callback's ``on_step_begin`` to
``on_step_end`` (both after the batch is collated); the process's resident set before the first step and its peak
over the steps (``ru_maxrss``), and their difference: what the step adds. Target (issue 54): our step at least 1.3x
as fast. Timings on a shared machine are noise; memory is not.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import pyplot, save_figure, summarize_sides, write_report  # noqa: E402

SIDES = ("ours", "trl")
LR = 1e-4
# The model's shapes beyond the tiny one's (the embedded processor fixes the vocabulary, image token and patches).
SIZES = {
    "tiny": {},
    "bench": {"dim": 512, "n_layers": 8, "n_heads": 8, "n_kv_heads": 4, "intermediate_dim": 1536,
              "mrope_section": (8, 12, 12),
              "vision": {"depth": 8, "dim": 384, "intermediate_dim": 1024, "n_heads": 6, "out_dim": 512,
                         "fullatt_block_indexes": (3, 7)}},
}


def model_args(size: str):
    """The ``Qwen2_5_VLArgs`` of ``size``: the tiny model's with ``SIZES[size]`` over them."""
    import dataclasses

    from torchtune_ac.models.families.qwen2_5_vl import QWEN2_5_VL_TINY

    changes = dict(SIZES[size])
    vision = dataclasses.replace(QWEN2_5_VL_TINY.vision, **changes.pop("vision", {}))
    return dataclasses.replace(QWEN2_5_VL_TINY, vision=vision, **changes)


def resident_gib() -> float:
    """The process's resident set now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**30


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB


def record_order(settings: dict) -> list[int]:
    """The records each side trains, in order: the task's from the first, as many epochs as the steps need."""
    from torchtune_ac.data.embedded import EMBEDDED_VLM_TRAIN_PATH

    n = len(Path(EMBEDDED_VLM_TRAIN_PATH).read_text().splitlines())
    return [i % n for i in range(settings["steps"] * settings["batch_size"])]


def run_ours(settings: dict) -> dict:
    import torch

    from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR, EMBEDDED_VLM_TRAIN_PATH
    from torchtune_ac.data.batching import SAMPLES
    from torchtune_ac.data.vision import build_vision_dataset, load_vision_processor
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.models.families.qwen2_5_vl import build
    from torchtune_ac.runtime.process_memory import keep_freed_memory
    from torchtune_ac.training.step import accumulate_gradients

    # glibc as a CPU run's open_run sets it (run/session.py): a step's freed blocks kept for the next step
    keep_freed_memory()
    processor = load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)
    # padding_free: as the family's shipped configs set it (configs/qwen2_5_vl, tiny/vlm)
    dataset = build_vision_dataset(EMBEDDED_VLM_TRAIN_PATH, processor, max_seq_len=settings["max_seq_len"],
                                   padding_free=True)
    order, b = record_order(settings), settings["batch_size"]
    collate = SAMPLES.collate_of(dataset)
    data = [collate([dataset[i] for i in order[k * b:(k + 1) * b]], pad_id=processor.tokenizer.pad_token_id)
            for k in range(settings["steps"])]
    pad = processor.tokenizer.pad_token_id
    torch.manual_seed(0)
    model = build(model_args(settings["size"]))
    model.init_weights()
    model.train()
    # fused: as the shipped Qwen2.5-VL configs set it (configs/qwen2_5_vl, tiny/vlm)
    stepper = build_optimizer(lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True), model,
                              in_backward=False)
    objective = loss_objective(1)
    before = resident_gib()
    seconds = []
    for batch in data:
        start = time.perf_counter()
        accumulate_gradients(model, stepper, [batch], scale=1.0 / int(batch["target_count"]), objective=objective)
        stepper.update(model, None)
        seconds.append(time.perf_counter() - start)
    return {"step_seconds": seconds, "step_tokens": [int((batch["tokens"] != pad).sum()) for batch in data],
            "resident_before_gib": before, "peak_gib": peak_gib(),
            "parameters": sum(p.numel() for p in model.parameters())}


def run_trl(settings: dict) -> dict:
    import datasets
    import torch
    import trl
    from PIL import Image
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, TrainerCallback

    from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR, EMBEDDED_VLM_TRAIN_PATH
    from torchtune_ac.data.vision import load_vision_processor
    from torchtune_ac.models.families.qwen2_5_vl import HF

    datasets.disable_progress_bars()
    seconds: list[float] = []
    tokens: list[int] = []
    marks: dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not marks:
                marks["before"] = resident_gib()
            marks["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - marks["start"])

    processor = load_vision_processor(EMBEDDED_VLM_PROCESSOR_DIR)
    folder = Path(EMBEDDED_VLM_TRAIN_PATH).parent
    lines = Path(EMBEDDED_VLM_TRAIN_PATH).read_text().splitlines()
    records = []
    for line in lines:
        record = json.loads(line)
        images = [Image.open(folder / path).convert("RGB") for path in record["images"]]
        records.append({"messages": record["messages"], "images": images})
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(**HF.hf_config_from_args(model_args(settings["size"]), torch.float32))
    config._attn_implementation = "sdpa"
    model = Qwen2_5_VLForConditionalGeneration(config)
    args = trl.SFTConfig(
        output_dir=settings["output_dir"], per_device_train_batch_size=settings["batch_size"], max_length=None,
        learning_rate=LR, weight_decay=0.0, optim="adamw_torch", lr_scheduler_type="constant", max_grad_norm=0.0,
        max_steps=settings["steps"], train_sampling_strategy="sequential", logging_steps=10**9, save_strategy="no",
        eval_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, seed=0, packing=False)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=processor, callbacks=[StepClock()])
    collate = trainer.data_collator

    def counting_collator(examples):
        batch = collate(examples)
        tokens.append(int(batch["attention_mask"].sum()))
        return batch

    trainer.data_collator = counting_collator
    trainer.train()
    return {"step_seconds": seconds, "step_tokens": tokens[:len(seconds)], "resident_before_gib": marks["before"],
            "peak_gib": peak_gib(), "parameters": sum(p.numel() for p in model.parameters())}


def worker(side: str, settings: dict) -> None:
    import torch

    torch.set_num_threads(settings["threads"])
    result = run_trl(settings) if side == "trl" else run_ours(settings)
    print(json.dumps({"side": side, **result}))


def summarize(runs: list[dict], warmup: int) -> dict:
    """Each side's median step (after ``warmup``) and memory over its runs.

    Raises:
        RuntimeError: the sides' steps did not hold the same tokens (not the same batches), or a run has no step
            left after the warm-up.
    """
    tokens = {tuple(r["step_tokens"]) for r in runs}
    if len(tokens) != 1:
        raise RuntimeError(f"the runs' steps held different tokens (not the same batches): {sorted(tokens)}")
    return summarize_sides(runs, SIDES, warmup, keep=("parameters",))


def format_table(report: dict) -> str:
    summary, settings = report["summary"], report["settings"]
    lines = [f"Qwen2.5-VL ({settings['size']}: {summary['ours']['parameters']:,} parameters) fp32, "
             f"{settings['threads']} thread(s), {settings['batch_size']} samples a step, {settings['steps']} steps, "
             f"the first {settings['warmup_steps']} not timed, {settings['repeats']} A/B/B/A round(s)",
             f"{'side':5} {'parameters':>12} {'s/step':>8} {'before GiB':>11} {'peak GiB':>9} {'step adds GiB':>14}"]
    for side, row in summary.items():
        lines.append(f"{side:5} {row['parameters']:>12,} {row['step_s']:>8.3f} {row['resident_before_gib']:>11.3f} "
                     f"{row['peak_gib']:>9.3f} {row['step_added_gib']:>14.3f}")
    lines.append(f"TRL step time / ours: {report['trl_over_ours']:.2f}x (target >= 1.3x); peak ours / TRL: "
                 f"{summary['ours']['peak_gib'] / summary['trl']['peak_gib']:.2f}x")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    summary = report["summary"]
    fig, (memory, time_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(summary)
    memory.bar(names, [summary[n]["peak_gib"] for n in names], label="peak resident set")
    memory.bar(names, [summary[n]["step_added_gib"] for n in names], label="added by the step")
    memory.set(ylabel="GiB", title="memory (one process)")
    memory.legend()
    time_ax.bar(names, [summary[n]["step_s"] for n in names], color=["tab:blue", "tab:orange"])
    time_ax.set(ylabel="seconds per step (median)", title="step time")
    fig.suptitle(f"Qwen2.5-VL {report['settings']['size']} on the embedded image-text task: ours against "
                 "transformers + TRL SFTTrainer, CPU fp32", fontsize=9)
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the tiny model, a few steps (checks that it runs)")
    parser.add_argument("--size", choices=sorted(SIZES), default="bench", help="the model's shapes")
    parser.add_argument("--batch-size", type=int, default=8, help="samples a step")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="first steps of each run not timed")
    parser.add_argument("--repeats", type=int, default=1, help="A/B/B/A rounds")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=128, help="our data's max_seq_len (no sample is longer)")
    parser.add_argument("--out-json", type=Path, default=REPO / "bench_results" / "bench_vlm.json")
    parser.add_argument("--out-png", type=Path, default=REPO / "docs" / "images" / "bench_vlm.png")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        worker(args.side, json.loads(args.settings))
        return 0
    if args.short:
        args.size, args.batch_size, args.steps, args.warmup_steps, args.repeats = "tiny", 2, 3, 1, 1
    settings = {"size": args.size, "batch_size": args.batch_size, "steps": args.steps, "threads": args.threads,
                "warmup_steps": args.warmup_steps, "repeats": args.repeats, "max_seq_len": args.max_seq_len,
                "output_dir": str(args.out_json.parent / "bench_vlm_trl_output")}
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": str(args.threads), "OMP_WAIT_POLICY": "PASSIVE"}
    runs = []
    for side in [*SIDES, *reversed(SIDES)] * args.repeats:
        done = subprocess.run([sys.executable, __file__, "--side", side, "--settings", json.dumps(settings)],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"bench_vlm: the {side} side failed (exit {done.returncode})")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"{side:>4}: {', '.join(f'{s:.2f}' for s in runs[-1]['step_seconds'])} s a step, peak "
              f"{runs[-1]['peak_gib']:.2f} GiB", flush=True)
    summary = summarize(runs, args.warmup_steps)
    report = {"settings": settings, "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
                                                "date": time.strftime("%Y-%m-%d")},
              "runs": runs, "summary": summary, "trl_over_ours": summary["trl"]["step_s"] / summary["ours"]["step_s"]}
    write_report(report, format_table(report), args.out_json, plot, args.out_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
