"""The embedded default model: ``llama_tiny`` with fixed random weights plus the embedded tokenizer.

It needs a model, the tokenizer and the checkpoint writer, so it sits above ``models``, ``data`` and
``checkpoint``. It lets every recipe and test run offline with no download. The weights are a pure function of the seed,
so the file bytes are identical on every machine with the same PyTorch; they are generated on first use
into a cache directory rather than shipped in the package.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import torch

from torchtune_ac.checkpoint import CONFIG_FILE, WEIGHTS_FILE
from torchtune_ac.data.embedded import EMBEDDED_TOKENIZER_DIR
from torchtune_ac.data.tokenizer import load_tokenizer
from torchtune_ac.models import save_hf
from torchtune_ac.models.families.llama import LLAMA_TINY, llama_tiny

EMBEDDED_CHECKPOINT_NAME = "tiny-llama-v1"
CACHE_ENV_VAR = "TORCHTUNE_AC_CACHE"
_SEED = 0
_INIT_STD = 0.02
_REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json")


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` if given, else ``$TORCHTUNE_AC_CACHE``, else ``~/.cache/torchtune_ac``."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    return Path.home() / ".cache" / "torchtune_ac"


def embedded_checkpoint_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the embedded checkpoint is (or will be) written; creates nothing (``tune validate`` names it)."""
    return resolve_cache_dir(cache_dir) / EMBEDDED_CHECKPOINT_NAME


def _read_special_token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    """bos/eos/pad ids of the embedded tokenizer, as ``save_hf`` keyword arguments."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    if tokenizer.vocab_size != LLAMA_TINY.vocab_size:
        raise RuntimeError(
            f"{tokenizer.path}: {tokenizer.vocab_size} tokens; llama_tiny expects {LLAMA_TINY.vocab_size}"
        )
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}


def ensure_embedded_checkpoint(
    cache_dir: str | os.PathLike | None = None,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> Path:
    """Return the embedded checkpoint directory, creating it if it is missing or incomplete.

    The checkpoint is ``llama_tiny`` seeded with ``torch.manual_seed(0)`` and ``init_weights(0.02)``, saved
    by ``save_hf`` (float32, one shard) with the tokenizer files. Creation is atomic and serialised by a
    lock file, so concurrent processes (e.g. the ranks of one job) all see a complete directory. The
    caller's random number generator state is left untouched.

    Args:
        cache_dir: parent directory; default ``$TORCHTUNE_AC_CACHE`` or ``~/.cache/torchtune_ac``.
        tokenizer_dir: where tokenizer.json and tokenizer_config.json come from; default the packaged
            ``torchtune_ac/data/embedded``.
        force: regenerate even if the checkpoint is complete.

    Returns:
        ``<cache_dir>/tiny-llama-v1``.

    Raises:
        FileNotFoundError: the tokenizer files are missing (a packaging bug).
    """
    out_dir = embedded_checkpoint_dir(cache_dir)
    if not force and _is_complete(out_dir):
        return out_dir
    tokenizer_dir = Path(EMBEDDED_TOKENIZER_DIR if tokenizer_dir is None else tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (tokenizer_dir / name).is_file():
            raise FileNotFoundError(f"embedded tokenizer file {tokenizer_dir / name} is missing")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished it while this one waited for the lock.
        if force or not _is_complete(out_dir):
            special_ids = _read_special_token_ids(tokenizer_dir)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_SEED)
                with torch.device("cpu"):
                    model = llama_tiny()
                model.init_weights(_INIT_STD)
            save_hf(model, out_dir, overwrite=True, tokenizer_dir=tokenizer_dir, **special_ids)
    return out_dir


def _is_complete(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in _REQUIRED_FILES)


EMBEDDED_VLM_CHECKPOINT_NAME = "tiny-qwen2_5_vl-v1"


def embedded_vlm_checkpoint_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the embedded vision-language checkpoint is (or will be) written; creates nothing."""
    return resolve_cache_dir(cache_dir) / EMBEDDED_VLM_CHECKPOINT_NAME


def ensure_embedded_vlm_checkpoint(cache_dir: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """The embedded vision-language checkpoint directory, created if missing: ``qwen2_5_vl_tiny`` seeded as
    ``ensure_embedded_checkpoint``'s model, saved with the embedded processor's files (its tokenizer, chat template
    and image processor), so that the processor loads from the checkpoint directory. Atomic, serialised by a lock.
    """
    from torchtune_ac.data.embedded import EMBEDDED_VLM_PROCESSOR_DIR
    from torchtune_ac.models.families.qwen2_5_vl import qwen2_5_vl_tiny

    out_dir = embedded_vlm_checkpoint_dir(cache_dir)
    if not force and _is_complete(out_dir):
        return out_dir
    processor_dir = Path(EMBEDDED_VLM_PROCESSOR_DIR)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or not _is_complete(out_dir):
            tokenizer = load_tokenizer(str(processor_dir))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_SEED)
                with torch.device("cpu"):
                    model = qwen2_5_vl_tiny()
                model.init_weights(_INIT_STD)
            save_hf(model, out_dir, overwrite=True, tokenizer_dir=processor_dir, bos_token_id=tokenizer.bos_id,
                    eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
            for path in processor_dir.iterdir():  # the processor's own files beside the tokenizer's
                if path.is_file() and not (out_dir / path.name).exists():
                    shutil.copyfile(path, out_dir / path.name)
    return out_dir
