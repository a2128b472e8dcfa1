"""Read back what the experiment trackers wrote, for the tests: TensorBoard event files and W&B offline runs."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any, Iterator

_WANDB_BLOCK = 32 * 1024  # the .wandb file is a LevelDB-style log: 32 KiB blocks of checksummed chunks
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def read_tensorboard(log_dir: Path) -> tuple[dict[str, dict[int, float]], list[str]]:
    """Scalars as ``{tag: {step: value}}`` (what TensorBoard shows, purged steps removed) and the text summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    tags = events.Tags()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in tags["scalars"]}
    texts = [s.decode() for tag in tags["tensors"] for e in events.Tensors(tag) for s in e.tensor_proto.string_val]
    return scalars, texts


def _wandb_chunks(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", f"{path} is not a W&B run file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _WANDB_BLOCK - pos % _WANDB_BLOCK
        if left < 7:  # block trailer: padding
            pos += left
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero-filled rest of a block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk


def _item_key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)  # W&B writes some keys as a one-element nested_key


def _wandb_records(run_file: Path, timeout: float = 30.0) -> list[Any]:
    """The records of a finished run. W&B's writer process may still be flushing the file after ``finish()``
    returns, so wait until its final ``exit`` record is there."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    deadline = time.monotonic() + timeout
    while True:
        records = []
        for chunk in _wandb_chunks(run_file):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(chunk)
            except DecodeError:  # the last chunk, half written
                break
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def read_wandb_offline_run(run_dir: Path) -> dict[str, Any]:
    """One ``offline-run-*`` folder: its run id, config and logged history (``{step: {key: value}}``)."""
    (run_file,) = run_dir.glob("run-*.wandb")
    run: dict[str, Any] = {"id": None, "config": {}, "history": {}}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"].update({_item_key(item): json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            run["config"].update({_item_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            values = {_item_key(item): json.loads(item.value_json) for item in record.history.item}
            run["history"][record.history.step.num] = {k: v for k, v in values.items() if not k.startswith("_")}
    return run


def read_wandb_offline_runs(output_dir: Path) -> list[dict[str, Any]]:
    """Every offline run W&B wrote under ``output_dir/wandb``, oldest first."""
    return [read_wandb_offline_run(d) for d in sorted((output_dir / "wandb").glob("offline-run-*"))]
