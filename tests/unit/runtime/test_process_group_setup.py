"""Joining the process group on CUDA, shown on a CPU with torch's CUDA and process-group functions stood in for:
the timeout and the NCCL + gloo backend reach ``init_process_group``, a ``LOCAL_RANK`` without a GPU is one
line naming it, TF32 is set on CUDA only, and host-side waits run on the group's CPU backend, never
``dist.barrier()`` (which on a group bound to a GPU runs on NCCL).

What only a GPU shows (NCCL's watchdog not firing while rank 0 writes a checkpoint longer than NCCL's default
timeout) is not tested here: the tests show that each host-side wait goes to gloo, where that watchdog does not
look, and that the group's timeout is the configured one.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from torchtune_ac.checkpoint import files
from torchtune_ac.config.schema import FullFinetuneConfig
from torchtune_ac.config.validation import validate_config
from torchtune_ac.errors import UnavailableError, UserError
from torchtune_ac.run import session
from torchtune_ac.runtime import distributed
from torchtune_ac.runtime.distributed import DistributedContext


def fake_cuda(monkeypatch, device_count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def launched_as(monkeypatch, *, rank: int, local_rank: int, world_size: int = 2) -> dict:
    """The elastic launcher's environment, with ``init_process_group`` recording its arguments instead."""
    for name, value in [("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world_size)]:
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(distributed, "_exit_with_launcher", lambda: None)  # no death signal for pytest itself
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    calls: dict = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: calls.update(kwargs))
    return calls


@pytest.mark.parametrize("device, cuda, backend, device_id", [
    ("cuda", True, "cuda:nccl,cpu:gloo", torch.device("cuda", 1)),
    ("auto", True, "cuda:nccl,cpu:gloo", torch.device("cuda", 1)),
    ("cpu", True, "gloo", None),
    ("auto", False, "gloo", None),
])
def test_the_timeout_and_the_backend_reach_init_process_group(monkeypatch, device, cuda, backend, device_id):
    if cuda:
        fake_cuda(monkeypatch, device_count=2)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = launched_as(monkeypatch, rank=3, local_rank=1)
    ctx = distributed.init_distributed(device, timeout_s=2700)
    assert calls == {"backend": backend, "timeout": timedelta(seconds=2700), "device_id": device_id}
    assert (ctx.rank, ctx.local_rank, ctx.world_size) == (3, 1, 2)


def test_the_default_timeout_is_the_config_default_and_longer_than_nccls():
    assert FullFinetuneConfig.__dataclass_fields__["distributed_timeout_s"].default == distributed.DEFAULT_TIMEOUT_S
    assert distributed.DEFAULT_TIMEOUT_S >= 3 * 600


@pytest.mark.parametrize("visible, shown", [("3", "CUDA_VISIBLE_DEVICES='3'"), (None, "CUDA_VISIBLE_DEVICES=unset")])
def test_a_local_rank_without_a_visible_gpu_is_one_line_naming_it(monkeypatch, visible, shown):
    fake_cuda(monkeypatch, device_count=1)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    calls = launched_as(monkeypatch, rank=1, local_rank=1)
    with pytest.raises(UnavailableError) as info:  # a UserError: exit status 2, no traceback
        distributed.init_distributed("auto")
    message = str(info.value)
    assert message.startswith(f"LOCAL_RANK=1: this process sees 1 GPU(s) ({shown})")
    assert "\n" not in message
    assert calls == {}  # refused before joining the group
    assert distributed.resolve_device("cuda", 0) == torch.device("cuda", 0)


@pytest.fixture
def tf32_flags():
    """TF32 flags set to what ``set_tf32`` must change, restored afterwards (torch's
    switches are properties, which monkeypatch cannot restore)."""
    saved = tf32()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def tf32() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


class Stop(Exception):
    pass


def config(**overrides) -> FullFinetuneConfig:
    return validate_config(
        {
            "output_dir": "/tmp/out",
            "model": {"_component_": "torchtune_ac.models.llama_tiny"},
            "tokenizer": {"_component_": "torchtune_ac.data.load_tokenizer", "path": "/tmp/tok"},
            "dataset": {"_component_": "torchtune_ac.data.instruct_dataset", "source": "d.jsonl"},
            "optimizer": {"_component_": "torch.optim.AdamW", "lr": 1e-3},
            **overrides,
        },
        FullFinetuneConfig,
        source="c.yaml",
    )


@pytest.mark.parametrize("device, overrides, expected", [
    (torch.device("cuda", 0), {}, (True, True)),
    (torch.device("cuda", 0), {"allow_tf32": False}, (False, False)),
    (torch.device("cpu"), {}, (False, False)),  # left as it was
])
def test_the_run_sets_tf32_on_cuda_only(monkeypatch, tf32_flags, device, overrides, expected):
    """``open_run`` up to taking output_dir's lock: the process group joined (stood in for), TF32 set from the
    config."""
    cfg = config(**overrides)
    joined = {}

    def init_distributed(device_name, *, timeout_s):
        joined.update(device=device_name, timeout_s=timeout_s)
        return DistributedContext(rank=0, world_size=1, local_rank=0, device=device)

    monkeypatch.setattr(session, "init_distributed", init_distributed)
    monkeypatch.setattr(session, "follow_live_tensors", lambda: None)
    monkeypatch.setattr(session, "keep_freed_memory", lambda: None)
    monkeypatch.setattr(session, "hold_output_dir", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop), session.open_run(cfg):
        pass
    assert tf32() == expected
    assert joined == {"device": "auto", "timeout_s": 1800}


@pytest.mark.parametrize("device, overrides, expected", [
    (torch.device("cpu"), {}, ["kept"]),  # the default: freed blocks kept for the next step, the faster step
    (torch.device("cpu"), {"ac_mode": "full"}, ["kept"]),
    (torch.device("cpu"), {"ac_mode": "auto", "ac_memory_budget_gib": 2.0, "max_seq_len": 64}, ["followed"]),
    (torch.device("cuda", 0), {"ac_mode": "auto", "max_seq_len": 64}, []),  # the host's allocator left alone
])
def test_the_cpu_allocator_follows_live_tensors_only_where_a_budget_must_hold(monkeypatch, device, overrides,
                                                                              expected):
    calls = []
    monkeypatch.setattr(session, "init_distributed", lambda device_name, *, timeout_s: DistributedContext(
        rank=0, world_size=1, local_rank=0, device=device))
    monkeypatch.setattr(session, "set_tf32", lambda device, *, allow_tf32: None)
    monkeypatch.setattr(session, "follow_live_tensors", lambda: calls.append("followed"))
    monkeypatch.setattr(session, "keep_freed_memory", lambda: calls.append("kept"))
    monkeypatch.setattr(session, "hold_output_dir", lambda *a, **k: (_ for _ in ()).throw(Stop()))
    with pytest.raises(Stop), session.open_run(config(**overrides)):
        pass
    assert calls == expected


def test_a_bad_timeout_names_the_key():
    with pytest.raises(UserError) as info:
        config(distributed_timeout_s=0)
    assert str(info.value) == "c.yaml: distributed_timeout_s=0: must be >= 1"


@pytest.fixture
def cuda_and_gloo_group():
    """A world of one whose group has a backend for CUDA tensors and gloo for CPU tensors, as on a GPU node
    (NCCL cannot be built into a CPU torch, so gloo stands in for it on the CUDA side too)."""
    dist.init_process_group("cuda:gloo,cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():  # the test may have torn it down itself
        dist.destroy_process_group()


def test_host_side_waits_and_object_collectives_run_on_the_cpu_backend(cuda_and_gloo_group, monkeypatch, tmp_path):
    """The barriers of the run, the checkpoint writer and the recipe state, and the object collectives of the
    directory writer and the shared-directory check: no ``dist.barrier()``, every tensor collective on a CPU
    tensor, and every object collective on the group's CPU side."""

    def no_barrier(*args, **kwargs):
        raise AssertionError("dist.barrier() runs on NCCL on a group bound to a GPU")

    reduced_on, objects_on = [], []
    all_reduce, object_device = dist.all_reduce, distributed_c10d._get_object_coll_device

    def recording_all_reduce(tensor, *args, **kwargs):
        reduced_on.append(tensor.device.type)
        return all_reduce(tensor, *args, **kwargs)

    def recording_object_device(group=None):
        objects_on.append(object_device(group))
        return objects_on[-1]

    gather = dist.all_gather_object

    def as_two_ranks(object_list, obj, group=None):  # the context says 2 ranks; the group here has 1
        one = [None]
        gather(one, obj, group=group)
        object_list[:] = one * len(object_list)

    monkeypatch.setattr(dist, "barrier", no_barrier)
    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)
    monkeypatch.setattr(dist, "all_gather_object", as_two_ranks)
    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", recording_object_device)
    ctx = DistributedContext(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    ctx.barrier()
    ctx.barrier()  # the checkpoint writer's and the recipe state's: the context's one barrier
    files.write_directory(tmp_path / "out", lambda tmp: (tmp / "f").write_text("x"), processes=ctx)
    files.check_shared_directory(tmp_path / "shared", "output_dir", ctx)  # a broadcast and an all-gather of objects
    assert (tmp_path / "out" / "f").read_text() == "x"
    assert reduced_on == ["cpu"] * 3
    assert objects_on and set(objects_on) == {"cpu"}
    distributed.destroy_distributed(synchronize=True)
    assert reduced_on == ["cpu"] * 4


def test_the_gpu_suite_starts_its_process_groups_as_tune_run_does():
    """A GPU test that starts an NCCL-only group has no backend for the checkpoint code's CPU barrier; every test
    under tests/gpu goes through runtime.distributed (``cuda:nccl,cpu:gloo``) instead of calling torch itself."""
    import pathlib

    suite = pathlib.Path(__file__).resolve().parents[2] / "gpu"
    sources = {path.name: path.read_text() for path in suite.glob("*.py")}
    assert sources
    # Two groups of their own, not a run's: torch's fake process group (a simulated world of 8, no collectives) and
    # two gloo ranks sharing one GPU (NCCL refuses two ranks on one device): the two-rank probe and the MoE stage's
    # expert parallelism of 2.
    own_groups = {"simulated_world.py": '"fake"', "test_two_ranks_cuda.py": '"gloo"', "test_moe_cuda.py": '"gloo"'}
    for name, backend in own_groups.items():
        assert f"init_process_group({backend}" in sources[name], name
    assert [name for name, text in sources.items() if "init_process_group(" in text and name not in own_groups] == []
