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

The sides are made alike, in fp32 on ``--threads`` threads: the same token ids (ours: BOS, prompt,
answer, EOS, truncated by our ``preference_dataset``; TRL is handed those ids, its own tokenization skipped), the same
pairs in the same order (``shuffle: false``; TRL's sampler ``sequential``; a last partial batch dropped by both), a
resident reference run forward every step (``dpo.reference: resident``; TRL given a ``ref_model``, nothing
precomputed), AdamW from ``torch.optim``, no activation checkpointing, no validation, logging or saving during the
steps. Packed takes as many rows a step as hold about ``--batch-size`` pairs on average (the table says how many it
held).

Measured per side: the optimizer steps' seconds (set-up, tokenization and the final save excluded; ours from
``metrics.jsonl``'s ``step_time_s``, TRL's from a callback's ``on_step_begin`` to ``on_step_end``; neither includes
fetching and collating the batch), leaving out the first ``--warmup-steps`` steps of each run (the first step
allocates the optimizer's state and the allocator's pools); pairs/s and tokens/s over the timed steps (tokens: those
steps' pairs' real tokens, prompt twice and both answers, BOS and EOS, no padding: what each side had to compute);
the process's peak resident set. Each step's answer tokens, as the run counted them (``target_tokens``, TRL's
``completion_mask``), are checked against the pairs the bench assigns to that step, so the three sides are known to
have trained the same pairs.

Why TRL's side once did not finish: the runs were too long, not TRL stalling. At the old defaults (256 pairs, 8 a
step, ``max_seq_len`` 512, ``--repeats 2``: twelve runs of a whole epoch) a padded epoch alone is 32 steps, about 8
minutes on one thread at the 16 s a step measured with 96 pairs (8 pairs pad to about 2.6 times their real tokens),
and TRL came third. TRL's own costs beside the same work: its LM head (``add_fused_lm_head``) scores every position
on a CPU (only the answers' on Triton devices), recomputes the projection in backward, and also computes entropy,
mean logits and top-1 for its logged metrics; and its model is given the batch's padding mask, where ours is causal
only. Its preprocessing (``dataset.map`` tokenizing prompt and prompt-plus-answer) is set-up, never timed, and
skipped here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
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


def describe_data(pairs_path: Path, max_seq_len: int, out: Path) -> dict:
    """What our data makes of the pairs: each pair's real tokens (prompt twice, both answers, BOS and EOS) and answer
    tokens, and the pairs each packed row holds; writes the tokenized pairs for TRL to ``out`` (the same token ids,
    truncated as ours)."""
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR, IGNORE_INDEX, load_tokenizer, preference_dataset

    tokenizer = load_tokenizer(EMBEDDED_TOKENIZER_DIR)
    padded = preference_dataset(tokenizer, source=str(pairs_path), max_seq_len=max_seq_len)
    packed = preference_dataset(tokenizer, source=str(pairs_path), max_seq_len=max_seq_len, packed=True)
    pair_tokens, answer_tokens, lines = [], [], []
    for i in range(len(padded)):
        sample = padded[i]
        chosen, rejected = sample["chosen_tokens"], sample["rejected_tokens"]
        prompt_len = next(k for k, label in enumerate(sample["chosen_labels"]) if label != IGNORE_INDEX) + 1
        pair_tokens.append(len(chosen) + len(rejected))
        answer_tokens.append(sum(label != IGNORE_INDEX for name in ("chosen", "rejected")
                                 for label in sample[f"{name}_labels"]))
        lines.append(json.dumps({"prompt_ids": chosen[:prompt_len], "chosen_ids": chosen[prompt_len:],
                                 "rejected_ids": rejected[prompt_len:]}))
    out.write_text("".join(line + "\n" for line in lines))
    rows = [packed.pair_range(r, r + 1) for r in range(len(packed))]
    return {"pairs": len(padded), "tokens": sum(pair_tokens), "rows": len(packed), "packing": packed.packing.describe(),
            "pair_tokens": pair_tokens, "answer_tokens": answer_tokens, "row_pairs": rows}


def step_pairs(side: str, batch: int, steps: int, data: dict) -> list[tuple[int, int]]:
    """The pairs (first, stop) each of a side's ``steps`` steps held: ``batch`` pairs in order (padded, TRL), or the
    pairs of ``batch`` rows in order (packed)."""
    if side != "packed":
        return [(k * batch, (k + 1) * batch) for k in range(steps)]
    rows = data["row_pairs"]
    return [(rows[k * batch][0], rows[(k + 1) * batch - 1][1]) for k in range(steps)]


def account(side: str, result: dict, data: dict, warmup: int) -> dict:
    """A side's reading: its steps after the first ``warmup`` (timed), their pairs and real tokens, tokens/s and
    pairs/s over their seconds.

    Raises:
        RuntimeError: a step's answer tokens, as the run counted them, are not those of the pairs the bench believes
            it held (the steps did not take the pairs in order: the comparison would not be of the same work).
    """
    seconds, counted = result["step_seconds"], result["step_answer_tokens"]
    spans = step_pairs(side, result["batch_size"], len(seconds), data)
    expected = [sum(data["answer_tokens"][a:b]) for a, b in spans]
    if counted != expected:
        raise RuntimeError(f"{side}: the steps' answer tokens {counted} are not those of the pairs in order "
                           f"{expected}")
    if len(seconds) <= warmup:
        raise RuntimeError(f"{side}: {len(seconds)} step(s), none left after {warmup} warm-up step(s): more --pairs")
    timed = spans[warmup:]
    tokens = sum(sum(data["pair_tokens"][a:b]) for a, b in timed)
    pairs = sum(b - a for a, b in timed)
    time_s = sum(seconds[warmup:])
    return {"seconds": time_s, "steps": len(timed), "warmup_s": sum(seconds[:warmup]), "pairs": pairs,
            "tokens": tokens, "pairs_per_step": pairs / len(timed), "peak_gib": result["peak_gib"],
            "batch_size": result["batch_size"], "pairs_per_s": pairs / time_s, "tokens_per_s": tokens / time_s}


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
                 "dpo.reference=resident", "save_every_n_steps=null", "log_every_n_steps=1",
                 f"optimizer.lr={settings['lr']}", f"optimizer.weight_decay={settings['weight_decay']}",
                 f"output_dir={out}"]
    if side == "packed":
        batch = max(1, round(batch * settings["rows"] / settings["pairs_count"]))
        overrides.append("dataset.packed=true")
    overrides.append(f"batch_size={batch}")
    subprocess.run([sys.executable, "-m", "torchtune_ac.cli", "run", "full_dpo", "--config", "tiny/dpo", *overrides],
                   check=True, capture_output=True, text=True, env=env(settings["threads"]), cwd=REPO)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"step_seconds": [r["step_time_s"] for r in records],
            "step_answer_tokens": [r["target_tokens"] for r in records],
            "peak_gib": max(r["peak_memory_gib"] for r in records), "batch_size": batch}


def run_trl(settings: dict, out: Path) -> dict:
    worker = {key: settings[key] for key in ("checkpoint", "batch_size", "max_length", "lr", "weight_decay", "threads")}
    worker.update(output_dir=str(out), tokenizer=settings["tokenizer"], pairs=settings["tokenized_pairs"])
    worker_script = Path(__file__).resolve().parent / "_dpo_trl_worker.py"
    done = subprocess.run([sys.executable, str(worker_script), json.dumps(worker)],
                          check=True, capture_output=True, text=True, env=env(settings["threads"]), cwd=REPO)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["batch_size"] = settings["batch_size"]
    return result


def run_speed(args: Any, root: Path) -> dict:
    """Every side ``--repeats`` times, interleaved A/B/C/C/B/A; the fastest run of each side is its reading."""
    from torchtune_ac.data import EMBEDDED_TOKENIZER_DIR

    pairs_path, checkpoint, tokenized = root / "pairs.jsonl", root / "checkpoint", root / "pairs_tokenized.jsonl"
    lengths = synthesise_pairs(args.pairs, args.length_scale, args.seed, pairs_path)
    write_checkpoint(args.model, checkpoint)
    data = describe_data(pairs_path, args.max_seq_len, tokenized)
    settings = {"model": args.model, "checkpoint": str(checkpoint), "pairs": str(pairs_path),
                "tokenized_pairs": str(tokenized), "tokenizer": str(EMBEDDED_TOKENIZER_DIR),
                "batch_size": args.batch_size, "max_length": args.max_seq_len, "lr": 1e-5, "weight_decay": 0.01,
                "threads": args.threads, "rows": data["rows"], "pairs_count": data["pairs"]}
    order = [*SIDES, *reversed(SIDES)] * args.repeats
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for index, side in enumerate(order):
        out = root / f"{index}_{side}"
        result = run_trl(settings, out) if side == "trl" else run_ours(side, settings, out)
        reading = account(side, result, data, args.warmup_steps)
        runs[side].append(reading)
        print(f"{side:>7}: {reading['seconds']:.2f} s for {reading['steps']} steps after {args.warmup_steps} warm-up "
              f"({reading['pairs_per_step']:.1f} pairs a step), {reading['tokens_per_s']:,.0f} tokens/s, peak "
              f"{reading['peak_gib']:.2f} GiB", flush=True)
    best = {side: max(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
    summary = {key: data[key] for key in ("pairs", "tokens", "rows", "packing")}
    return {"model": args.model, "dtype": "fp32", "threads": args.threads, "max_seq_len": args.max_seq_len,
            "batch_pairs": args.batch_size, "warmup_steps": args.warmup_steps, "length_scale": args.length_scale,
            "lengths_drawn": lengths, "data": summary, "runs": runs, "best_tokens_per_s": best,
            "packed_over_padded": best["packed"] / best["padded"], "packed_over_trl": best["packed"] / best["trl"]}


def format_speed(speed: dict) -> str:
    lines = [f"{speed['model']} fp32, {speed['threads']} thread(s), {speed['data']['pairs']} pairs "
             f"({speed['data']['tokens']:,} tokens), {speed['batch_pairs']} pairs a step (packed: as many rows as hold "
             f"about that), max_seq_len {speed['max_seq_len']}, the first {speed['warmup_steps']} step(s) of each run "
             f"not timed; {speed['data']['packing']}",
             "side     tokens/s (best)  pairs/s  peak GiB  timed steps  pairs a step  batch"]
    for side, rs in speed["runs"].items():
        best = max(rs, key=lambda r: r["tokens_per_s"])
        lines.append(f"{side:<8} {best['tokens_per_s']:>15,.0f}  {best['pairs_per_s']:>7.2f}  "
                     f"{max(r['peak_gib'] for r in rs):>8.2f}  {best['steps']:>11}  {best['pairs_per_step']:>12.1f}  "
                     f"{best['batch_size']:>5}")
    lines.append(f"packed / padded: {speed['packed_over_padded']:.2f}x (target >= 1.3x); packed / TRL: "
                 f"{speed['packed_over_trl']:.2f}x (target > 1x)")
    return "\n".join(lines)


def plot_speed(speed: dict, path: Path) -> None:
    from _benchlib import pyplot, save_figure

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sides = list(speed["runs"])
    left.bar(sides, [speed["best_tokens_per_s"][s] for s in sides], color=["tab:grey", "tab:blue", "tab:orange"])
    left.set(ylabel="tokens/s (best run, after warm-up)",
             title=f"DPO on CPU: {speed['model']} fp32, {speed['batch_pairs']} pairs/step")
    right.bar(sides, [max(r["peak_gib"] for r in speed["runs"][s]) for s in sides],
              color=["tab:grey", "tab:blue", "tab:orange"])
    right.set(ylabel="peak resident set (GiB)", title="memory (the process's peak)")
    save_figure(fig, path)
