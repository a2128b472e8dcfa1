"""The known noise of torchao and torch is dropped, once installed, and nothing else those libraries say."""

from __future__ import annotations

import logging
import warnings

import pytest

from torchtune_ac.observability.third_party_noise import KNOWN_LOG_NOISE, _DropMatching, filter_known_noise

NOISE = [
    ("torchao", "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                "Could not load this library: /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64"
                "-linux-gnu.so"),
    ("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                            "torch.compile as an opaque value type. Calling register_constant() on Enum subclasses "
                            "is deprecated and will be an error in a future release."),
    ("torch.distributed.tensor._redistribute",
     "While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), Replicate()), 2 "
     "sequential all_gather operations will be performed. This is suboptimal: multiple collective operations have "
     "higher latency (separate kernel launches and synchronization points) and may give inconsistent results "
     "between ranks due to different reduction orders. it is not possible to merge non-ascending order all_gather "
     "operations."),
]
KEPT = [("torchao", "Failed to quantize layer 3"), ("torch.utils._pytree", "something else entirely"),
        ("torch.distributed.tensor._redistribute",  # a reduction in two steps is not noise
         "While redistributing from (_NormPartial(2.0), _NormPartial(2.0)) to (Replicate(), Replicate()), 2 "
         "sequential all_reduce operations will be performed. This is suboptimal: multiple collective operations "
         "have higher latency (separate kernel launches and synchronization points) and may give inconsistent "
         "results between ranks due to different reduction orders. To optimize, flatten mesh dimensions "
         "[\"shard\", \"tp\"] so DTensor can use a single operation instead.")]


@pytest.fixture
def heard():
    """What the two libraries' loggers pass on, with their filters restored afterwards (nothing leaks)."""
    records: list[tuple[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((record.name, record.getMessage()))

    loggers = [logging.getLogger(name) for name, _ in KNOWN_LOG_NOISE]
    saved = [list(logger.filters) for logger in loggers]
    handler = Collect()
    for logger in loggers:
        logger.addHandler(handler)
        # As in a process where no entry point ran (an in-process `tune` main of another test installs them).
        logger.filters[:] = [f for f in logger.filters if not isinstance(f, _DropMatching)]
    yield records
    for logger, filters in zip(loggers, saved):
        logger.removeHandler(handler)
        logger.filters[:] = filters


def test_known_noise_is_dropped_and_the_rest_kept(heard):
    for name, message in NOISE + KEPT:
        logging.getLogger(name).warning(message)
    assert heard == NOISE + KEPT  # nothing is filtered before an entry point asks
    heard.clear()
    filter_known_noise()
    filter_known_noise()  # twice: one filter per logger
    assert [len(logging.getLogger(name).filters) for name, _ in KNOWN_LOG_NOISE] == [1, 1, 1]
    for name, message in NOISE + KEPT:
        logging.getLogger(name).warning(message)
    assert heard == KEPT
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filter_known_noise()
        warnings.warn("OptimState8bit does not implement _stable_hash_for_caching. For PT2-compatible tensor "
                      "subclasses, it is recommended to implement it", UserWarning)
        warnings.warn("a warning of our own", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning of our own"]
