"""A LoRA step against a full fine-tuning step, a QLoRA step and PEFT driven by TRL's ``SFTTrainer``, on CPU, side
by side.

    python scripts/bench/bench_lora.py                 # 4 sides x --repeats, a table, bench_results/lora.{json,png}
    python scripts/bench/bench_lora.py --sides lora qlora   # QLoRA's step against plain LoRA's alone
    python scripts/bench/bench_lora.py --short         # a few steps of a small batch: checks that it runs
    python scripts/bench/bench_lora.py --compile --sides lora peft   # compiled: our blocks, TRL's torch_compile
    python scripts/bench/bench_lora.py --model llama_medium --ac full --batch-size 1 --seq-len 256
                                                       # where LoRA is used: the weights' state outweighs activations

Two workloads answer two questions. The default (``llama_small``, 8 x 512 tokens, no AC) is step-time bound and
activation bound: LoRA saves the gradients and AdamW state of 32 M parameters, about 0.4 GiB, against 2-3 GiB of
activations that no adapter changes. ``--model llama_medium --ac full`` (about 160 M parameters, full AC, as the
8B LoRA configs run) is the regime adapters are for, where the trained weights' state is most of the peak.

Sides, each in a fresh process, one after another (their peak resident sets apart):

  * ``full``: our step (``training/step.py``'s ``accumulate_gradients`` then the stepper's update) training every
    parameter of ``llama_small`` (32 M parameters, 8 blocks);
  * ``lora``: the same step on the same model with LoRA (``torchtune_ac/lora/``: rank 8, alpha 16, on q, k, v, o and
    the MLP's three projections; the base frozen: gradients and AdamW state for the adapters alone);
  * ``qlora``: the ``lora`` side with ``quantize_base: nf4``: the adapted linears' frozen base weights stored as
    torchao's ``NF4Tensor`` (``quantize_base_``, as a run does after loading), each matmul dequantising its weight;
  * ``peft``: Hugging Face's ``LlamaForCausalLM`` of the same shapes (our family's ``config.json`` for them) with
    PEFT 0.21's LoRA of the same rank, alpha and targets, trained by TRL's ``SFTTrainer``.

The sides are made alike: fp32 on ``--threads`` threads, the same batches (random token ids drawn from one seed,
``--batch-size`` rows of ``--seq-len`` tokens, every position a target; TRL is handed the ids pre-tokenized, its
sampler sequential, nothing padded), AdamW from ``torch.optim`` at the same learning rate, no activation
checkpointing, no dropout, no gradient clipping (TRL: max_grad_norm 0), no logging, validation or saving during the steps. The weights
differ (each side draws its own initialisation): the work and the memory do not depend on them.

Measured per side: each optimizer step's seconds, leaving out the first ``--warmup-steps`` (the first allocates
AdamW's state and the allocator's pools), ours around the step, TRL's from a callback's ``on_step_begin`` to
``on_step_end``; the process's resident set before the first step (model, optimizer, batches; the heap's free pages
handed back first) and its peak over the steps (``VmHWM``, reset before the first step: the ``qlora`` side builds its
base dense, then quantises it), and their difference: what the step adds (the whole process's peak, set-up included,
is kept in the JSON as ``process_peak_gib``); and the frozen base's bytes per parameter, counted
from its tensors' storage (an ``NF4Tensor`` from its inner tensors: 4-bit codes, a scale per 64 weights, a factor
per 256 scales), over the adapted linears' base weights and over every frozen parameter. Timings on a shared machine
are noise; memory and bytes are not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from _benchlib import (peak_gib, process_peak_gib, pyplot, reset_peak, resident_gib, run_side,  # noqa: E402
                       save_figure, summarize_sides, write_report)

SIDES = ("full", "lora", "qlora", "peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR = 8, 16, 1e-4
MODELS = ("llama_small", "llama_medium")


def model_args(name: str):
    """``llama_small`` (32 M), or ``llama_medium``: the same family at dim 1024, 12 blocks (about 160 M)."""
    import dataclasses

    from torchtune_ac.models.families.llama import LLAMA_SMALL

    if name == "llama_small":
        return LLAMA_SMALL
    return dataclasses.replace(LLAMA_SMALL, dim=1024, n_layers=12, n_heads=16, n_kv_heads=8, intermediate_dim=2816)


def stored_bytes(tensor) -> int:
    """The bytes ``tensor``'s storage holds: a tensor subclass (torchao's ``NF4Tensor``) from its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(stored_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def frozen_base_bytes(model) -> dict:
    """Bytes per parameter of the frozen base: its adapted linears' weights, and every frozen parameter."""
    from torchtune_ac.lora.mechanism import adapted_linears

    adapted = [linear.weight for _, linear in adapted_linears(model)]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    return {"adapted_base_bytes_per_param": sum(map(stored_bytes, adapted)) / sum(w.numel() for w in adapted),
            "frozen_bytes_per_param": sum(map(stored_bytes, frozen)) / sum(p.numel() for p in frozen)}


def batches(settings: dict) -> list:
    """The same token ids for every side: ``steps`` batches of ``[batch_size, seq_len]``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, model_args(settings["model"]).vocab_size, (settings["batch_size"], settings["seq_len"]), generator=generator)
            for _ in range(settings["steps"])]


def run_ours(settings: dict, side: str) -> dict:
    import torch

    from torchtune_ac.lora.config import AdapterConfig, QuantizeBase
    from torchtune_ac.lora.mechanism import apply_adapters, initialize_adapters_, quantize_base_
    from torchtune_ac.memory.chunked_loss import loss_objective
    from torchtune_ac.memory.optimizer_in_backward import build_optimizer
    from torchtune_ac.activation_checkpointing import setup_activation_checkpointing
    from torchtune_ac.models.llama import Llama
    from torchtune_ac.runtime.process_memory import keep_freed_memory
    from torchtune_ac.training.step import accumulate_gradients

    # glibc as a CPU run's open_run sets it (run/session.py): a step's freed blocks kept for the next step
    keep_freed_memory()
    torch.manual_seed(0)
    model = Llama(model_args(settings["model"]))
    base_bytes = {}
    if side in ("lora", "qlora"):
        quantize = QuantizeBase.NF4 if side == "qlora" else None
        apply_adapters(model, AdapterConfig(rank=RANK, alpha=ALPHA, targets=TARGETS, quantize_base=quantize))
        if quantize:  # a run's order: the base loaded, then quantised, then the adapters drawn
            quantize_base_(model)
        initialize_adapters_(model, seed=0)
        base_bytes = frozen_base_bytes(model)
    setup_activation_checkpointing(model, ac_mode=settings["ac"])
    if settings.get("compile"):  # as ``compile: true`` does (run/assemble.py): each block, after AC
        for block in model.layers:
            block.compile()
    model.train()
    stepper = build_optimizer(lambda params: torch.optim.AdamW(params, lr=LR), model, in_backward=False)
    objective = loss_objective(1)
    data = [{"tokens": tokens, "labels": tokens, "target_count": torch.tensor(tokens.numel())}
            for tokens in batches(settings)]
    reset_peak()
    before = resident_gib()
    seconds = []
    for batch in data:
        start = time.perf_counter()
        accumulate_gradients(model, stepper, [batch], scale=1.0 / int(batch["target_count"]), objective=objective)
        stepper.update(model, None)
        seconds.append(time.perf_counter() - start)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"step_seconds": seconds, "resident_before_gib": before, "peak_gib": peak_gib(),
            "process_peak_gib": process_peak_gib(), "trainable": trainable, **base_bytes}


def run_peft(settings: dict) -> dict:
    import datasets
    import peft
    import torch
    import trl
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, TrainerCallback

    from torchtune_ac.embedded import ensure_embedded_checkpoint
    from torchtune_ac.models import LLAMA
    seconds: list[float] = []
    marks: dict[str, float] = {}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not marks:
                reset_peak()
                marks["before"] = resident_gib()
            marks["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds.append(time.perf_counter() - marks["start"])

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA.hf.hf_config_from_args(model_args(settings["model"]), torch.float32))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                                       target_modules=TARGETS, task_type="CAUSAL_LM"))
    records = [{"input_ids": row.tolist()} for tokens in batches(settings) for row in tokens]
    args = trl.SFTConfig(
        output_dir=settings["output_dir"], per_device_train_batch_size=settings["batch_size"],
        max_length=settings["seq_len"], learning_rate=LR, weight_decay=0.0, optim="adamw_torch",
        lr_scheduler_type="constant", max_grad_norm=0.0, max_steps=settings["steps"], train_sampling_strategy="sequential",
        logging_steps=10**9, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=settings["ac"] == "full", gradient_checkpointing_kwargs={"use_reentrant": False},
        dataloader_num_workers=0, seed=0, packing=False, torch_compile=bool(settings.get("compile")),
        dataset_kwargs={"skip_prepare_dataset": True})
    tokenizer = PreTrainedTokenizerFast.from_pretrained(ensure_embedded_checkpoint())
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(records),
                             processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"step_seconds": seconds, "resident_before_gib": marks["before"], "peak_gib": peak_gib(),
            "process_peak_gib": process_peak_gib(), "trainable": trainable}


def worker(side: str, settings: dict) -> None:
    import torch

    torch.set_num_threads(settings["threads"])
    result = run_peft(settings) if side == "peft" else run_ours(settings, side)
    print(json.dumps({"side": side, **result}))


def summarize(runs: list[dict], sides: list[str], warmup: int) -> dict:
    summary = summarize_sides(runs, sides, warmup, keep=("trainable",))
    for side in sides:
        first = next(r for r in runs if r["side"] == side)
        summary[side].update({key: first[key] for key in ("adapted_base_bytes_per_param", "frozen_bytes_per_param")
                              if key in first})
    return summary


def ratio(summary: dict, key: str, top: str, bottom: str) -> str:
    if top not in summary or bottom not in summary:
        return ""
    return f"{top} / {bottom} {key}: {summary[top][key] / summary[bottom][key]:.2f}x"


def format_table(report: dict) -> str:
    summary = report["summary"]
    lines = [f"{'side':6} {'trainable':>12} {'s/step':>8} {'before GiB':>11} {'peak GiB':>9} {'step adds GiB':>14} "
             f"{'base B/param':>13}"]
    for side, row in summary.items():
        base = row.get("adapted_base_bytes_per_param")
        lines.append(f"{side:6} {row['trainable']:>12,} {row['step_s']:>8.3f} {row['resident_before_gib']:>11.3f} "
                     f"{row['peak_gib']:>9.3f} {row['step_added_gib']:>14.3f} "
                     f"{'' if base is None else f'{base:.3f}':>13}")
    lines.append("; ".join(filter(None, [ratio(summary, "peak_gib", "lora", "full"),
                                         ratio(summary, "step_s", "peft", "lora"),
                                         ratio(summary, "step_s", "qlora", "lora"),
                                         ratio(summary, "peak_gib", "qlora", "lora")])))
    if "qlora" in summary:
        lines.append(f"qlora's frozen base: {summary['qlora']['adapted_base_bytes_per_param']:.3f} bytes a weight in "
                     f"its adapted linears (NF4), {summary['qlora']['frozen_bytes_per_param']:.3f} over every frozen "
                     "parameter (the embeddings, norms and output projection stay in fp32)")
    return "\n".join(lines)


def draw(report: dict, path: Path) -> None:
    summary, settings = report["summary"], report["settings"]
    plt = pyplot()
    fig, (memory, time_ax) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = list(summary)
    memory.bar(names, [summary[n]["peak_gib"] for n in names], label="peak resident set")
    memory.bar(names, [summary[n]["step_added_gib"] for n in names], label="added by the step")
    memory.set_ylabel("GiB")
    memory.legend()
    memory.set_title("memory (one process)")
    time_ax.bar(names, [summary[n]["step_s"] for n in names])
    time_ax.set_ylabel("seconds per step (median)")
    time_ax.set_title("step time (noise on a shared machine)")
    fig.suptitle(f"{settings['model']}, {settings['batch_size']} x {settings['seq_len']} tokens, AC {settings['ac']}: "
                 "full fine-tuning, our LoRA and QLoRA (NF4 base), PEFT + TRL SFTTrainer, CPU fp32", fontsize=9)
    save_figure(fig, path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a few steps of a small batch (checks that it runs)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each side, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", choices=MODELS, default="llama_small")
    parser.add_argument("--ac", choices=("none", "full"), default="none", help="activation checkpointing, every side")
    parser.add_argument("--compile", action="store_true",
                        help="our sides compile each block (compile: true), TRL compiles its model (torch_compile)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES), help="which sides to run")
    parser.add_argument("--out", default=str(REPO / "bench_results" / "lora"), help="PREFIX for PREFIX.json, .png")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        worker(args.side, json.loads(args.settings))
        return 0
    if args.short:
        args.batch_size, args.seq_len, args.steps, args.warmup_steps, args.repeats = 2, 64, 3, 1, 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {"model": args.model, "ac": args.ac, "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": args.steps, "threads": args.threads,
                "compile": args.compile, "output_dir": str(out.parent / "lora_trl_output")}
    sides = [side for side in SIDES if side in args.sides]
    runs = [run_side(Path(__file__), side, settings, args.threads) for _ in range(args.repeats) for side in sides]
    summary = summarize(runs, sides, args.warmup_steps)
    report = {"settings": settings, "machine": {"cpus": os.cpu_count(), "load_average": os.getloadavg(),
                                                "date": time.strftime("%Y-%m-%d")},
              "runs": runs, "summary": summary}
    write_report(report, format_table(report), out.with_suffix(".json"), draw, out.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
