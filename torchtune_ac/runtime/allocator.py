"""The CUDA caching allocator's settings a run starts with.

By default the allocator carves fixed segments, and a block freed in one cannot serve a request larger than what is
left of it: the memory it reserves grows above what is allocated. On an H100, a compiled bf16 step of
``llama_small`` with full AC reserved 0.818 GiB for a 0.668 GiB allocated peak (1.22x), outside the planner's 15 %;
with expandable segments, which map pages into one growing segment per stream, the same step stayed within it, the
1B benchmark reserved 0.25 GiB less, and its speed did not change (``bench_results/gpu_*``). So a run uses
expandable segments unless its environment configures the allocator itself: ``PYTORCH_ALLOC_CONF``,
``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_HIP_ALLOC_CONF``, whichever is set, is left as it is. It must be set before
CUDA's allocator reads it, at its first allocation: the ``tune`` console script, each launched process and the
benchmarks set it first thing. Nothing changes on a CPU. The variable set is ``PYTORCH_CUDA_ALLOC_CONF``, the name
every torch this project supports (2.6 and later) reads; newer ones also read ``PYTORCH_ALLOC_CONF``. torchtitan's
launch script sets the same.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional

# Any of them configures the allocator (PYTORCH_HIP_ALLOC_CONF on ROCm builds): the default is then not set.
ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
DEFAULT_ALLOC_CONF = "expandable_segments:True"


def use_expandable_segments_by_default(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless the allocator is configured already; say
    whether it was set. Processes started afterwards (the launcher's workers) inherit it."""
    env = os.environ if environ is None else environ
    if any(name in env for name in ALLOC_CONF_VARS):
        return False
    env["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOC_CONF
    return True
