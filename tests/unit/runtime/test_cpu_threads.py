"""The CPU threads a run starts with: its free share of the cores it may use, OpenMP's spin count bounded, and the
user's own settings left as they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from torchtune_ac.runtime import cpu_threads
from torchtune_ac.runtime.cpu_threads import (
    DECIDED_VAR,
    SPIN_COUNT,
    THREAD_VARS,
    CpuView,
    decide_threads,
    describe_threads,
    set_thread_defaults,
    worker_environment,
)

SPIN = {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


@pytest.mark.parametrize("view, environ, nproc, expected", [
    # A quiet machine: every usable core; the spin count bounded.
    (CpuView(2), {}, 1, {"OMP_NUM_THREADS": "2", **SPIN}),
    (CpuView(64), {}, 1, {"OMP_NUM_THREADS": "64", **SPIN}),
    # Other processes busy: only the free cores, rounded, and at least one.
    (CpuView(2, busy=1.0), {}, 1, {"OMP_NUM_THREADS": "1", **SPIN}),
    (CpuView(2, busy=0.6), {}, 1, {"OMP_NUM_THREADS": "1", **SPIN}),
    (CpuView(2, busy=0.2), {}, 1, {"OMP_NUM_THREADS": "2", **SPIN}),  # a passing process does not cost a core
    (CpuView(16, busy=0.25), {}, 1, {"OMP_NUM_THREADS": "12", **SPIN}),
    # The cgroup's quota: its cores rounded, at least one.
    (CpuView(16, quota=4.0), {}, 1, {"OMP_NUM_THREADS": "4", **SPIN}),
    (CpuView(16, quota=2.4), {}, 1, {"OMP_NUM_THREADS": "2", **SPIN}),
    (CpuView(16, quota=1.5), {}, 1, {"OMP_NUM_THREADS": "2", **SPIN}),
    (CpuView(16, quota=0.2), {}, 1, {"OMP_NUM_THREADS": "1", **SPIN}),
    (CpuView(2, quota=8.0), {}, 1, {"OMP_NUM_THREADS": "2", **SPIN}),
    # The processes of a node share the cores, and what is free of them.
    (CpuView(8), {}, 4, {"OMP_NUM_THREADS": "2", **SPIN}),
    (CpuView(2), {}, 4, {"OMP_NUM_THREADS": "1", **SPIN}),
    (CpuView(5), {}, 2, {"OMP_NUM_THREADS": "2", **SPIN}),
    (CpuView(8, busy=0.5), {}, 2, {"OMP_NUM_THREADS": "2", **SPIN}),
    # The user's own: left as set, the others still decided.
    (CpuView(2, busy=1.0), {"OMP_NUM_THREADS": "2"}, 1, SPIN),
    (CpuView(2), {"OMP_WAIT_POLICY": "PASSIVE"}, 1, {"OMP_NUM_THREADS": "2"}),
    (CpuView(2), {"GOMP_SPINCOUNT": "300000"}, 1, {"OMP_NUM_THREADS": "2"}),
    (CpuView(2), {"OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE"}, 1, {}),
])
def test_the_decision(view, environ, nproc, expected) -> None:
    settings = decide_threads(view, environ, nproc)
    assert settings.environment == expected
    assert settings.users == environ


def test_the_reason_names_the_busy_share_only_where_it_cost_threads() -> None:
    assert decide_threads(CpuView(2, busy=1.0), {}).why == \
        "1 thread(s) on 2 usable core(s), 100% of them busy with other processes at start"
    assert decide_threads(CpuView(2, busy=0.1), {}).why == "2 thread(s) on 2 usable core(s)"
    assert decide_threads(CpuView(8), {}, 4).why == "2 thread(s) for each of 4 processes sharing 8 usable core(s)"


@pytest.fixture
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set, then deleted: monkeypatch puts back (or removes) what the code under test sets in os.environ.
    for name in (*THREAD_VARS, DECIDED_VAR):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_the_log_line_says_what_tune_set_and_what_it_left(clean_environ) -> None:
    env = {"OMP_NUM_THREADS": "4"}
    set_thread_defaults(env)
    assert describe_threads(env) == \
        f"OMP_NUM_THREADS=4 from the environment, left as set; GOMP_SPINCOUNT={SPIN_COUNT} by default"
    env = {}
    set_thread_defaults(env, view=CpuView(2, busy=1.0))
    assert describe_threads(env) == (f"OMP_NUM_THREADS=1, GOMP_SPINCOUNT={SPIN_COUNT} by default (1 thread(s) on 2 "
                                     "usable core(s), 100% of them busy with other processes at start)")
    assert describe_threads({}) == "OpenMP's defaults"
    assert DECIDED_VAR not in os.environ  # an environment given: nothing else changed


def test_the_launcher_gives_its_workers_their_share_and_keeps_the_users(monkeypatch, clean_environ) -> None:
    monkeypatch.setattr(cpu_threads, "_physical_cores", lambda cpus: 8)
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: None)
    launcher = {}
    set_thread_defaults(launcher, view=CpuView(8))
    record = json.loads(launcher[DECIDED_VAR])
    launcher[DECIDED_VAR] = json.dumps({**record, "pid": record.pop("parent")})  # as the tune command records it
    assert launcher["OMP_NUM_THREADS"] == "8"
    workers = worker_environment(launcher, 4)
    assert workers["OMP_NUM_THREADS"] == "2" and "GOMP_SPINCOUNT" not in workers  # the launcher's stays
    assert json.loads(workers[DECIDED_VAR])["parent"] == os.getpid()
    # The machine as the tune command saw it: busy then, fewer threads now.
    busy = {**launcher, DECIDED_VAR: json.dumps({**json.loads(launcher[DECIDED_VAR]), "busy": 0.75})}
    assert worker_environment(busy, 2)["OMP_NUM_THREADS"] == "1"
    # The user's own threads reach every worker as they are.
    users = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    assert set(worker_environment(users, 4)) == {DECIDED_VAR}


def test_a_worker_keeps_what_its_launcher_decided(monkeypatch, clean_environ) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(DECIDED_VAR, json.dumps({"set": {"OMP_NUM_THREADS": "1"}, "why": "", "parent": os.getppid()}))
    assert set_thread_defaults() is None
    assert os.environ["OMP_NUM_THREADS"] == "1" and "GOMP_SPINCOUNT" not in os.environ


def test_what_another_tune_process_set_is_decided_again(monkeypatch, clean_environ) -> None:
    """A ``tune run`` started by another process that decided for itself (a benchmark's): its values are tune's,
    not the user's. With torch imported, the threads are set through torch, and the spin count is not set."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv(DECIDED_VAR, json.dumps({"set": {"OMP_NUM_THREADS": "2"}, "why": "", "pid": 1}))
    monkeypatch.setattr(cpu_threads, "read_cpu_view", lambda: CpuView(2, busy=1.0))
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    settings = set_thread_defaults()
    assert settings is not None and settings.users == {} and threads == [1]
    assert os.environ["OMP_NUM_THREADS"] == "1" and "GOMP_SPINCOUNT" not in os.environ
    assert json.loads(os.environ[DECIDED_VAR])["pid"] == os.getpid()


def test_tune_run_sets_them_before_torch_is_imported(tmp_path) -> None:
    """What libgomp reads when torch is imported after ``tune run`` started: the decided threads."""
    code = ("import os, sys\n"
            "from torchtune_ac import cli\n"
            "cli.main(['run', 'no_such_recipe'])\n"
            "import torch\n"
            "print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], os.environ['GOMP_SPINCOUNT'])\n")
    env = {name: value for name, value in os.environ.items() if name not in (*THREAD_VARS, DECIDED_VAR)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    threads, variable, spin = result.stdout.split()
    assert threads == variable and int(threads) >= 1 and spin == str(SPIN_COUNT), result.stderr


@pytest.mark.parametrize("files, expected", [
    ({"proc/self/cgroup": "0::/job\n", "sys/fs/cgroup/job/cpu.max": "150000 100000\n"}, 1.5),
    ({"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "max 100000\n"}, None),
    # In a container, /proc/self/cgroup names the host's path; the container's cgroup is mounted at the root.
    ({"proc/self/cgroup": "0::/docker/abc\n", "sys/fs/cgroup/cpu.max": "200000 100000\n"}, 2.0),
    ({"proc/self/cgroup": "4:cpu,cpuacct:/job\n", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "50000\n",
      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, 0.5),
    ({"proc/self/cgroup": "4:cpu,cpuacct:/\n", "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
      "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),
])
def test_the_cgroup_quota(tmp_path, files, expected) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_threads._cgroup_quota(tmp_path) == expected


def test_cpus_kept_busy_by_other_processes_read_as_busy() -> None:
    cpus = cpu_threads._affinity()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in cpus]
    try:
        time.sleep(0.5)  # started and spinning
        assert min(cpu_threads._busy_shares(cpus, 0.1, 2)) > 0.8
    finally:
        for process in busy:
            process.kill()
            process.wait()


def ticks(*busy_shares: float, per_look: int = 12):
    """``_cpu_times`` of 2 CPUs over looks of ``per_look`` clock ticks: (busy, total) since boot before each look and
    after it, each look's busy share given."""
    busy, total, times = 1000, 4000, [(1000, 4000)]
    for share in busy_shares:
        busy, total = busy + round(share * per_look), total + per_look
        times.append((busy, total))
    return iter(times)


@pytest.mark.parametrize("shares, threads", [
    ((1.0, 0.0, 0.0, 0.0, 0.0), "2"),  # a burst in the first look (issue 51: 3 busy ticks decided the whole run)
    ((0.5, 0.75, 0.0, 0.0, 0.1), "2"),  # a burst over two looks
    ((1.0, 0.9, 1.0, 0.8, 1.0), "1"),  # load that lasts (issue 44: beside 4 busy processes) still costs threads
    ((0.5, 1.0, 0.0, 1.0, 0.75), "1"),  # load most of the time
])
def test_a_burst_at_start_does_not_cost_a_quiet_run_its_threads(monkeypatch, shares, threads) -> None:
    times = ticks(*shares)
    monkeypatch.setattr(cpu_threads, "_cpu_times", lambda cpus: next(times))
    monkeypatch.setattr(cpu_threads, "_physical_cores", lambda cpus: 2)
    monkeypatch.setattr(cpu_threads, "_cgroup_quota", lambda: None)
    view = cpu_threads.read_cpu_view(sample_s=0.0)
    assert decide_threads(view, {}).environment["OMP_NUM_THREADS"] == threads
    assert cpu_threads.typical_busy(shares) == sorted(shares)[2]
