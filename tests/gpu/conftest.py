"""The GPU suite (``scripts/gpu/gpu_check.sh``): every test here is marked ``cuda`` and skipped without a CUDA device.

The helpers of the CPU tests (the dense attention oracle, the ``tune run`` helpers, the numerics rule) are shared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent
for folder in (TESTS / "unit" / "models", TESTS / "integration"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

pytest.register_assert_rewrite("finetune_runs")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.cuda)
