"""Keep every test off the user's home: Hugging Face and W&B caches and settings go to a temporary folder.

Set in ``pytest_configure``, before any test module imports ``datasets`` (which reads its cache location at
import), and inherited by every ``tune`` subprocess. No test reaches the Hub: ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_ENV_DIRS = {
    "HF_HOME": "hf_home",
    "HF_DATASETS_CACHE": "hf_datasets_cache",
    "WANDB_DIR": "wandb",
    "WANDB_CACHE_DIR": "wandb_cache",
    "WANDB_CONFIG_DIR": "wandb_config",
    "WANDB_DATA_DIR": "wandb_data",
}
_root: list[str] = []


def pytest_configure(config) -> None:
    root = tempfile.mkdtemp(prefix="torchtune_ac-tests-")
    _root.append(root)
    for name, folder in _ENV_DIRS.items():
        os.environ[name] = os.path.join(root, folder)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["WANDB_MODE"] = "offline"


def pytest_unconfigure(config) -> None:
    for root in _root:
        shutil.rmtree(root, ignore_errors=True)
