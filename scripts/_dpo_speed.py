"""``bench_dpo.py --only speed``: padded DPO, packed DPO (``dataset.packed: true``) and TRL's ``DPOTrainer`` on the
same model, pairs, batch and precision, on CPU, interleaved in fresh processes.

The pairs have UltraFeedback's length spread, made from the embedded pairs (whose own answers are a few tokens).
Each length is drawn from a log-normal, then scaled by ``--length-scale`` so that a CPU run stays short:

    prompt:            median 110 tokens, sigma 0.9, clipped to [8, 2048]
    chosen, rejected:  median 260 tokens, sigma 0.75 each, drawn apart, clipped to [4, 2048]

Why these: the published token-length statistics of ``HuggingFaceH4/ultrafeedback_binarized`` (Llama-family
tokenizers) put the prompts' median near 100 tokens with a long tail past 1,000, and the responses' median between
200 and 300 tokens, from a handful to a few thousand, the chosen and the rejected answer of a pair often far apart.
A log-normal has that shape (a hump and a long right tail); what matters for padding is the spread of lengths
within a batch, which sigma sets. No UltraFeedback data is read (nothing is downloaded): the text is the embedded
pairs' prompts and answers strung together until the drawn length, in tokens of the embedded tokenizer.

Measured per side: the optimizer steps' seconds (set-up, tokenization and the final save excluded; ours from
``metrics.jsonl``'s ``step_time_s``, TRL's from a callback's ``on_step_begin`` to ``on_step_end``), over one epoch
of the pairs; pairs/s and tokens/s over that time (tokens: the pairs' real tokens, prompt twice and both answers, as
the embedded tokenizer counts them: the same number for the three sides, no padding); the process's peak resident
set. Packed takes as many rows a step as hold about ``--batch-size`` pairs on average, so that all three take
about the same pairs a step.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SIDES = ("padded", "packed", "trl")
PROMPT_LENGTHS = (110, 0.9, 8, 2048)  # median, sigma, min, max (tokens, before --length-scale)
ANSWER_LENGTHS = (260, 0.75, 4, 2048)


def draw_length(rng: random.Random, spread: tuple[float, float, int, int], scale: float) -> int:
    median, sigma, low, high = spread
    return max(1, round(scale * min(high, max(low, rng.lognormvariate(0.0, sigma) * median))))


def text_of_length(rng: random.Random, pool: list[str], length: int, hf_tokenizer: Any) -> str:
    """Embedded texts strung together, cut to ``length`` tokens."""
    ids: list[int] = []
    while len(ids) < length:
        ids += hf_tokenizer.encode(" " + rng.choice(pool), add_special_tokens=False)
    return hf_tokenizer.decode(ids[:length]).strip() or "."


def synthesise_pairs(n_pairs: int, scale: float, seed: int, out: Path) -> dict:
    """Write ``n_pairs`` prompt/chosen/rejected strings with UltraFeedback's length spread (module docstring) to
    ``out``; return the drawn lengths' summary."""
    from transformers import PreTrainedTokenizerFast

    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR
    from torchtune_ac.data.embedded import EMBEDDED_PREFERENCE_DIR

    hf_tokenizer = PreTrainedTokenizerFast.from_pretrained(EMBEDDED_TOKENIZER_DIR)
    records = [json.loads(line) for line in (Path(EMBEDDED_PREFERENCE_DIR) / "train.jsonl").read_text().splitlines()]
    prompts = [r["prompt"] for r in records]
    answers = [r[key] for r in records for key in ("chosen", "rejected")]
    rng = random.Random(seed)
    pairs, drawn = [], {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(n_pairs):
        lengths = {"prompt": draw_length(rng, PROMPT_LENGTHS, scale), "chosen": draw_length(rng, ANSWER_LENGTHS, scale),
                   "rejected": draw_length(rng, ANSWER_LENGTHS, scale)}
        pair = {name: text_of_length(rng, prompts if name == "prompt" else answers, n, hf_tokenizer)
                for name, n in lengths.items()}
        if pair["chosen"] == pair["rejected"]:
            pair["rejected"] += " no"
        pairs.append(pair)
        for name, n in lengths.items():
            drawn[name].append(n)
    out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return {name: quantiles(values) for name, values in drawn.items()}


def quantiles(values: list[int]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"min": ordered[0], "p10": pick(0.1), "median": pick(0.5), "p90": pick(0.9), "max": ordered[-1],
            "mean": sum(ordered) / len(ordered)}


def write_checkpoint(model_name: str, out: Path) -> None:
    """The model from the seed, saved as a Hugging Face checkpoint: the weights both ``tune run`` and TRL load."""
    import torch

    from torchtune_ac import models
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, load_tokenizer

    torch.manual_seed(0)
    model = getattr(models, model_name)()
    model.init_weights(0.02)
    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    models.save_hf(model, out, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
                   pad_token_id=tokenizer.pad_id, tokenizer_dir=EMBEDDED_TOKENIZER_DIR)


def describe_data(pairs_path: Path, max_seq_len: int) -> dict:
    """What our data makes of the pairs: their real tokens, and the rows packing makes."""
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, load_tokenizer, preference_dataset

    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    padded = preference_dataset(tokenizer, source=str(pairs_path), max_seq_len=max_seq_len)
    packed = preference_dataset(tokenizer, source=str(pairs_path), max_seq_len=max_seq_len, packed=True)
    tokens = sum(len(padded[i]["chosen_tokens"]) + len(padded[i]["rejected_tokens"]) for i in range(len(padded)))
    return {"pairs": len(padded), "tokens": tokens, "rows": len(packed), "packing": packed.packing.describe()}


def env(threads: int) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_ours(side: str, settings: dict, out: Path) -> dict:
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR

    batch = settings["batch_size"]
    overrides = [f"model._component_=torchtune_ac.models.{settings['model']}",
                 f"checkpoint_dir={settings['checkpoint']}",
                 f"tokenizer.path={EMBEDDED_TOKENIZER_DIR}", f"dataset.source={settings['pairs']}", "dataset_val=null",
                 "run_val_every_n_steps=null", f"max_seq_len={settings['max_length']}", "shuffle=false",
                 "max_steps_per_epoch=null", "epochs=1", "enable_activation_checkpointing=false",
                 "save_every_n_steps=null", "log_every_n_steps=1", f"optimizer.lr={settings['lr']}",
                 f"output_dir={out}"]
    if side == "packed":
        batch = max(1, round(batch * settings["rows"] / settings["pairs_count"]))
        overrides.append("dataset.packed=true")
    overrides.append(f"batch_size={batch}")
    subprocess.run([sys.executable, "-m", "torchtune_ac.cli", "run", "full_dpo", "--config", "tiny/dpo", *overrides],
                   check=True, capture_output=True, text=True, env=env(settings["threads"]), cwd=REPO)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"step_seconds": [r["step_time_s"] for r in records], "peak_gib": max(r["peak_memory_gib"] for r in records),
            "batch_size": batch}


def run_trl(settings: dict, out: Path) -> dict:
    worker = {key: settings[key] for key in ("checkpoint", "pairs", "batch_size", "max_length", "lr", "threads")}
    worker.update(output_dir=str(out), tokenizer=settings["tokenizer"], pairs=settings["pairs"])
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "_dpo_trl_worker.py"), json.dumps(worker)],
                          check=True, capture_output=True, text=True, env=env(settings["threads"]), cwd=REPO)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["batch_size"] = settings["batch_size"]
    return result


def run_speed(args: Any, root: Path) -> dict:
    """Every side ``--repeats`` times, interleaved A/B/C/C/B/A; the fastest epoch of each side is its reading."""
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR

    pairs_path, checkpoint = root / "pairs.jsonl", root / "checkpoint"
    lengths = synthesise_pairs(args.pairs, args.length_scale, args.seed, pairs_path)
    write_checkpoint(args.model, checkpoint)
    data = describe_data(pairs_path, args.max_seq_len)
    settings = {"model": args.model, "checkpoint": str(checkpoint), "pairs": str(pairs_path),
                "tokenizer": str(EMBEDDED_TOKENIZER_DIR), "batch_size": args.batch_size, "max_length": args.max_seq_len,
                "lr": 1e-5, "threads": args.threads, "rows": data["rows"], "pairs_count": data["pairs"]}
    order = [*SIDES, *reversed(SIDES)] * args.repeats
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for index, side in enumerate(order):
        out = root / f"{index}_{side}"
        result = run_trl(settings, out) if side == "trl" else run_ours(side, settings, out)
        seconds = sum(result["step_seconds"])
        runs[side].append({"seconds": seconds, "steps": len(result["step_seconds"]), "peak_gib": result["peak_gib"],
                           "batch_size": result["batch_size"], "pairs_per_s": data["pairs"] / seconds,
                           "tokens_per_s": data["tokens"] / seconds})
        print(f"{side:>7}: {seconds:.2f} s for {len(result['step_seconds'])} steps, {data['tokens'] / seconds:,.0f} "
              f"tokens/s, peak {result['peak_gib']:.2f} GiB", flush=True)
    best = {side: max(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
    return {"model": args.model, "dtype": "fp32", "threads": args.threads, "max_seq_len": args.max_seq_len,
            "batch_pairs": args.batch_size, "length_scale": args.length_scale, "lengths_drawn": lengths, "data": data,
            "runs": runs, "best_tokens_per_s": best,
            "packed_over_padded": best["packed"] / best["padded"], "packed_over_trl": best["packed"] / best["trl"]}


def format_speed(speed: dict) -> str:
    lines = [f"{speed['model']} fp32, {speed['threads']} thread(s), {speed['data']['pairs']} pairs "
             f"({speed['data']['tokens']:,} tokens), about {speed['batch_pairs']} pairs a step, max_seq_len "
             f"{speed['max_seq_len']}; {speed['data']['packing']}",
             "side     tokens/s (best)  pairs/s  peak GiB  steps  batch"]
    for side, rs in speed["runs"].items():
        best = max(rs, key=lambda r: r["tokens_per_s"])
        lines.append(f"{side:<8} {best['tokens_per_s']:>15,.0f}  {best['pairs_per_s']:>7.2f}  "
                     f"{max(r['peak_gib'] for r in rs):>8.2f}  {best['steps']:>5}  {best['batch_size']:>5}")
    lines.append(f"packed / padded: {speed['packed_over_padded']:.2f}x (target >= 1.3x); packed / TRL: "
                 f"{speed['packed_over_trl']:.2f}x (target > 1x)")
    return "\n".join(lines)


def plot_speed(speed: dict, path: Path) -> None:
    from _benchlib import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sides = list(speed["runs"])
    left.bar(sides, [speed["best_tokens_per_s"][s] for s in sides], color=["tab:grey", "tab:blue", "tab:orange"])
    left.set(ylabel="tokens/s (best epoch)",
             title=f"DPO on CPU: {speed['model']} fp32, {speed['batch_pairs']} pairs/step")
    right.bar(sides, [max(r["peak_gib"] for r in speed["runs"][s]) for s in sides],
              color=["tab:grey", "tab:blue", "tab:orange"])
    right.set(ylabel="peak resident set (GiB)", title="memory (the process's peak)")
    save_figure(fig, path)
