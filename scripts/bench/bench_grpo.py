"""Benchmark one GRPO step on CPU: ours (``generation.generate`` with the static KV cache, then the GRPO loss pass of
``training/grpo.py``, backward and AdamW) against TRL 1.16's ``GRPOTrainer`` (transformers' ``generate``), each side
in a fresh process of its own.

    .venv/bin/python scripts/bench/bench_grpo.py            # 8 prompts x 4 completions of 64 tokens, 3 steps a run
    .venv/bin/python scripts/bench/bench_grpo.py --quick    # 4 x 4 of 16 tokens, 1 timed step (about a minute)

Same work on both sides: one random Llama (``--dim``, ``--layers``, the embedded tokenizer's 512 tokens), saved
with ``save_hf`` and loaded by both; the same prompt texts tokenized by the same tokenizer; ``num_generations``
completions per prompt of exactly ``max_new_tokens`` tokens (no end-of-sequence: ours stops on no token, TRL is
given ``min_new_tokens``), temperature 1, no top-k/top-p; ``beta: 0``, ``loss_type: dapo``, one iteration; one
reward (a constant function of the text's length); fp32; ``torch.optim.AdamW``; the same number of threads. The
first step is a warm-up and not timed. Ours sets glibc's allocator as a CPU run does (``keep_freed_memory``,
``runtime/process_memory.py``); TRL's is glibc's default, as a TRL user's is.

The sides run in turns, A B B A (``--repeats`` rounds, 2 by default; ``--quick`` one), each run in a fresh process,
and each side's timed steps are pooled over its runs, so that the machine's drift falls on both. Timed apart: the
generation (ours: ``generate``; TRL: its ``_generate``), and the rest of the step (ours: rewards,
advantages, the loss pass's forward and backward and the optimizer step; TRL: the step's time minus its
``_generate``). ``--compile``: ours decodes with the compiled one-token step (``generation.compile``); its
compilation falls in the warm-up step, whose generation time is reported apart. ``--cpu-time``: each worker's CPU
seconds instead of the wall clock, for a loaded machine. Writes ``bench_results/bench_grpo.json``.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOKENIZER_DIR = REPO / "torchtune_ac" / "data" / "embedded"
SIDES = ("ours", "trl")
PROMPTS = ["What is 3 + 4?", "Add 12 and 30.", "Name a prime number.", "What is 9 times 9?",
           "Count to five.", "What is 100 - 1?", "Spell seven.", "Is 17 prime?"]


def reward_by_length(completions, **kwargs):
    """The same reward on both sides: a fixed function of each completion's text."""
    return [float(len(c) % 7) for c in completions]


def write_checkpoint(out: Path, dim: int, layers: int) -> None:
    import shutil

    import torch

    from torchtune_ac.models import save_hf
    from torchtune_ac.models.llama import Llama, LlamaArgs

    torch.manual_seed(0)
    args = LlamaArgs(vocab_size=512, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, intermediate_dim=2 * dim,
                     max_seq_len=512)
    model = Llama(args)
    model.init_weights()
    save_hf(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, out / name)


def worker_clock(s: dict):
    """Wall-clock seconds, or with ``--cpu-time`` the worker's CPU seconds (on one thread, what it computed: less
    moved by other work on a loaded machine than the wall clock, though caches shared with it still slow it)."""
    return time.process_time if s["cpu_time"] else time.perf_counter


def run_ours(s: dict) -> dict:
    import torch

    clock = worker_clock(s)

    torch.set_num_threads(s["threads"])
    from transformers import PreTrainedTokenizerFast

    from torchtune_ac.generation import SamplingConfig, generate
    from torchtune_ac.models import load_hf
    from torchtune_ac.runtime.process_memory import keep_freed_memory
    from torchtune_ac.training.grpo import GRPOConfig, GRPOObjective, ScaleRewards, group_advantages
    from torchtune_ac.training.rollouts import rollout_batch

    # glibc as a CPU run's open_run sets it (run/session.py): a step's freed blocks kept for the next step
    keep_freed_memory()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(s["checkpoint"])
    model = load_hf(s["checkpoint"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g, new = s["num_generations"], s["max_new_tokens"]
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:s["prompts"]] for _ in range(g)]
    config = GRPOConfig(num_generations=g, beta=0.0)
    objective = GRPOObjective(config, n_chunks=1, temperature=1.0, max_new_tokens=new)
    sampling = SamplingConfig(max_new_tokens=new, temperature=1.0)
    generation, rest = [], []
    for step in range(1 + s["steps"]):
        started, wall_started = clock(), time.perf_counter()
        model.eval()
        done = generate(model, prompts, sampling, eos_ids=[-1], pad_id=tokenizer.pad_token_id,
                        generator=torch.Generator().manual_seed(step), compile_decode=s["compile"])
        generated, wall_generated = clock(), time.perf_counter()
        model.train()
        texts = tokenizer.batch_decode(done.tokens)
        rewards = torch.tensor(reward_by_length(texts))
        advantages = group_advantages(rewards, g, ScaleRewards.GROUP).advantages
        # The recipe's own loss-pass batch (prompt and completion in one right-padded row, labels shifted).
        batch = rollout_batch(prompts, done.tokens, done.truncated, advantages, pad_id=tokenizer.pad_token_id,
                              mask_truncated=False)
        parts = objective(model, batch)
        (parts.loss / objective.targets(batch)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ended = clock()
        assert all(len(c) == new for c in done.tokens)
        if step:
            generation.append(generated - started)
            rest.append(ended - generated)
        else:
            # Wall-clock seconds (inductor compiles in worker processes): with --compile, the compilation included.
            first_generation = wall_generated - wall_started
    return {"generation_s": generation, "rest_s": rest, "first_generation_s": first_generation}


def run_trl(s: dict) -> dict:
    import torch

    clock = worker_clock(s)

    torch.set_num_threads(s["threads"])
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback

    datasets.disable_progress_bars()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(s["checkpoint"])
    model = AutoModelForCausalLM.from_pretrained(s["checkpoint"], torch_dtype=torch.float32)
    g, new, n = s["num_generations"], s["max_new_tokens"], s["prompts"]
    data = datasets.Dataset.from_list([{"prompt": p} for p in PROMPTS[:n]] * (1 + s["steps"]))
    steps, generation = [], []

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = clock()

        def on_step_end(self, args, state, control, **kwargs):
            steps.append(clock() - self.started)

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate(self, prompts):
            started = clock()
            out = super()._generate(prompts)
            generation.append(clock() - started)
            return out

    config = trl.GRPOConfig(
        output_dir=s["output_dir"], per_device_train_batch_size=n * g, num_generations=g,
        max_completion_length=new, generation_kwargs={"min_new_tokens": new}, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", num_iterations=1, learning_rate=1e-5, optim="adamw_torch", max_grad_norm=0.0,
        max_steps=1 + s["steps"], train_sampling_strategy="sequential", logging_steps=10**9, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, seed=0, dataloader_num_workers=0)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward_by_length, args=config, train_dataset=data,
                               processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    return {"generation_s": generation[1:], "rest_s": [t - gen for t, gen in zip(steps[1:], generation[1:])]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true",
                        help="ours with compile_decode (generation.compile); its compilation, in the untimed warm-up "
                        "step, is reported apart")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each worker's CPU seconds (time.process_time) instead of the wall clock")
    parser.add_argument("--repeats", type=int, default=2,
                        help="A/B/B/A rounds: each side runs twice a round, in a fresh process each time")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        settings = json.loads(args.settings)
        print(json.dumps((run_ours if args.worker == "ours" else run_trl)(settings)))
        return 0
    shape = dict(prompts=4, num_generations=4, max_new_tokens=16, steps=1) if args.quick else \
        dict(prompts=8, num_generations=4, max_new_tokens=64, steps=3)
    load = os.getloadavg()[0]
    if args.quick:
        args.repeats = 1
    results: dict = {"settings": {**shape, "dim": args.dim, "layers": args.layers, "threads": args.threads,
                                  "compile": args.compile, "cpu_time": args.cpu_time, "repeats": args.repeats},
                     "load_1min_before": load}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "model"
        write_checkpoint(checkpoint, args.dim, args.layers)
        runs = []
        for number, side in enumerate([*SIDES, *reversed(SIDES)] * args.repeats):
            settings = {**results["settings"], "checkpoint": str(checkpoint),
                        "output_dir": str(Path(tmp) / f"{side}{number}")}
            done = subprocess.run([sys.executable, __file__, "--worker", side, "--settings", json.dumps(settings)],
                                  capture_output=True, text=True, cwd=REPO)
            if done.returncode:
                sys.stderr.write(done.stderr[-3000:])
                return 1
            runs.append({"side": side, **json.loads(done.stdout.strip().splitlines()[-1])})
            print(f"{side:>4}: generation {', '.join(f'{t:.3f}' for t in runs[-1]['generation_s'])} s, the rest "
                  f"{', '.join(f'{t:.3f}' for t in runs[-1]['rest_s'])} s", flush=True)
    results["runs"] = runs
    for side in SIDES:  # each side's steps pooled over its runs
        mine = [run for run in runs if run["side"] == side]
        results[side] = {key: [t for run in mine for t in run[key]] for key in ("generation_s", "rest_s")}
        if side == "ours":
            results[side]["first_generation_s"] = [run["first_generation_s"] for run in mine]
    results["load_1min_after"] = os.getloadavg()[0]
    med = {side: {k: statistics.median(results[side][k]) for k in ("generation_s", "rest_s")}
           for side in SIDES}
    for side in med:
        med[side]["step_s"] = med[side]["generation_s"] + med[side]["rest_s"]
    results["median"] = med
    results["trl_over_ours"] = {k: med["trl"][k] / med["ours"][k] for k in med["ours"]}
    out = REPO / "bench_results" / "bench_grpo.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    clock = "CPU seconds" if args.cpu_time else "seconds"
    print(f"load (1 min) {load:.2f} before, {results['load_1min_after']:.2f} after; {clock} (median):")
    for key in ("generation_s", "rest_s", "step_s"):
        print(f"  {key:<13} ours {med['ours'][key]:.3f}  TRL {med['trl'][key]:.3f}  "
              f"TRL/ours {results['trl_over_ours'][key]:.2f}x")
    if args.compile:
        first = statistics.median(results["ours"]["first_generation_s"])
        print(f"  ours' first generation (compiling the decode step) {first:.1f} s wall clock (median of its runs)")
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
