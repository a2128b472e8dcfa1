"""Create the embedded tiny checkpoint (``llama_tiny``, seed 0, with the embedded tokenizer) if it is missing.

    python scripts/make_tiny_checkpoint.py                 # into $TORCHTUNE_AC_CACHE or ~/.cache/torchtune_ac
    python scripts/make_tiny_checkpoint.py --out /tmp/c    # into /tmp/c/tiny-llama-v1
    python scripts/make_tiny_checkpoint.py --force         # regenerate even if it is complete

Prints the checkpoint directory, its parameter count and the sha256 of model.safetensors (identical on every
run with the same PyTorch).
"""

import argparse
import hashlib

from torchtune_ac.checkpoint import WEIGHTS_FILE
from torchtune_ac.embedded import ensure_embedded_checkpoint
from torchtune_ac.models import load_hf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", metavar="DIR", help="cache directory; the checkpoint is DIR/tiny-llama-v1")
    parser.add_argument("--force", action="store_true", help="regenerate even if the checkpoint is complete")
    args = parser.parse_args()

    path = ensure_embedded_checkpoint(args.out, force=args.force)
    n_params = sum(p.numel() for p in load_hf(path).parameters())
    digest = hashlib.sha256((path / WEIGHTS_FILE).read_bytes()).hexdigest()
    print(path)
    print(f"parameters: {n_params:,}")
    print(f"sha256({WEIGHTS_FILE}): {digest}")


if __name__ == "__main__":
    main()
