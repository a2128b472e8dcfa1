"""Summarise a finished run: did the loss fall, and does transformers load its last checkpoint?

    python scripts/check_run.py OUTPUT_DIR

Prints the loss curve in a few numbers, then loads the newest checkpoint with both
``transformers.AutoModelForCausalLM`` and ``torchtune_ac.models.load_hf`` and compares their logits.
Exit status 1 if the loss did not fall or the two disagree.
"""

import argparse
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

from torchtune_ac.checkpoint import list_checkpoints
from torchtune_ac.models import load_hf
from torchtune_ac.observability.metrics import read_metrics
from torchtune_ac.observability.third_party_noise import filter_known_noise


def main() -> int:
    filter_known_noise()
    transformers.logging.disable_progress_bar()  # its loading bar, in the quick start's output
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    args = parser.parse_args()

    records = read_metrics(args.output_dir)
    losses = [r["loss"] for r in records]
    window = max(1, len(losses) // 10)
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"loss: mean of first {window} step(s) {first:.3f} -> mean of last {window} step(s) {last:.3f} "
          f"over {len(losses)} steps ({records[-1]['tokens_per_second']:,.0f} tokens/s at the end)")

    checkpoint = list_checkpoints(args.output_dir)[-1]
    hf_model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    ours = load_hf(checkpoint).eval()
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf_model(tokens).logits - ours(tokens)).abs().max().item()
    print(f"checkpoint {checkpoint}: transformers loads it; max |logit difference| vs torchtune_ac = {diff:.2e}")

    ok = last < first and diff <= 1e-4
    print("OK" if ok else "PROBLEM: the loss did not fall or the logits disagree")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
