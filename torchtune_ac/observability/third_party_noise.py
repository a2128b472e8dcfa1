"""Known noise of the libraries a run imports, filtered out of what the ``tune`` command and the scripts print.

Each entry is a message a library prints on every import or first step that says nothing about the run, matched
exactly enough that anything else those libraries say still shows:

- torchao, imported by transformers whenever it loads a model (its quantizers) or by a config's torchao optimizer,
  logs ``Failed to load .../torchao/_C_*.so`` for each of its CUDA kernel libraries built for another Python or
  GPU, and registers enums that torch (``torch.utils._pytree``) calls deprecated;
- DTensor, under tensor parallelism, warns on every rank at each save that gathering the full weights (sharded
  over the shard and tp dimensions, in that nesting) takes one all-gather per dimension: gathers copy, so their
  order changes no value, and a save has to gather whatever the order (reductions, such as the gradient norm,
  take one collective: ``Parallelism.build_mesh`` flattens the two dimensions for them);
- torch's compile cache warns that torchao's 8-bit optimizer state (``OptimState8bit``) cannot be hashed for it.

Installed by entry points only (``tune`` and its worker processes, ``scripts/``), never on import: a library
must not change what its callers' processes (or the tests) log.
"""

from __future__ import annotations

import logging
import re
import warnings

# (logger, pattern of its message) for log records.
KNOWN_LOG_NOISE = (
    ("torchao", r"Failed to load \S*torchao\S*/_C_\S+\.so: "),
    ("torch.utils._pytree", r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile "),
    ("torch.distributed.tensor._redistribute",
     r"While redistributing from .* to .*, \d+ sequential all_gather operations will be performed\. This is "
     r"suboptimal\b.* it is not possible to merge non-ascending order all_gather operations\.$"),
)
# (pattern of the message, category) for Python warnings.
KNOWN_WARNING_NOISE = ((r"\w+ does not implement _stable_hash_for_caching", UserWarning),)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def filter_known_noise() -> None:
    """Drop the messages of ``KNOWN_LOG_NOISE`` and ``KNOWN_WARNING_NOISE`` from now on in this process (more calls
    change nothing)."""
    for name, pattern in KNOWN_LOG_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
    for pattern, category in KNOWN_WARNING_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=category)
