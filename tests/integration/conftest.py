"""Fixtures of the integration tests: a private cache for the embedded checkpoint, shared by every run."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

pytest.register_assert_rewrite("finetune_runs")

from torchtune_ac.embedded import CACHE_ENV_VAR, ensure_embedded_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def embedded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point ``$TORCHTUNE_AC_CACHE`` at a per-session directory (inherited by every ``tune`` subprocess) and
    write the embedded checkpoint there once, so runs never touch the user's ``~/.cache``."""
    cache = tmp_path_factory.mktemp("torchtune_ac_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV_VAR, str(cache))
        yield ensure_embedded_checkpoint()
