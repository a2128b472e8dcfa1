"""The CPU threads a run starts with: as many as it has free cores, and OpenMP threads that stop spinning soon.

torch's CPU work runs on OpenMP's threads (libgomp). Between two parallel regions each thread spins for about
300,000 iterations before it sleeps: on a machine of its own that saves a wake-up, but beside other busy processes
the spinning threads take the cores the work needs (issue 44: on 2 cores, 20 steps of ``tiny/full`` took 48-69 s
beside 4 busy processes, against 19 s with one thread and 4.7 s on a quiet machine). So a run decides, once at
start (``decide_threads``, pure):

- threads: the cores it may use (its CPU affinity, physical cores only, and its cgroup's CPU quota), divided among
  the processes of the node (``tune run --nproc_per_node N``), less the share of them other processes kept busy
  while it looked (``read_cpu_view``: the median of 5 looks of 60 ms at ``/proc/stat``, so that a burst at start,
  another process starting or ending, fills fewer than half of them and does not cost a quiet run its threads,
  while load that lasts fills them all; issue 51: one 50 ms look, about 5 clock ticks a core, let 3 busy ticks
  halve a quiet run's threads);
- ``GOMP_SPINCOUNT=10000``: a thread sleeps after 10,000 spins, so load that comes later costs less (issue 44: 30 s
  instead of 48-69; on a quiet machine 4.7 s, as with the default).

A variable the user set (``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT``) is left as it is, and the
run's log says so (``describe_threads``). libgomp reads the variables once, when torch is imported: the ``tune``
command sets them first thing, and the launcher gives each worker its own; a recipe started another way
(``torchrun recipes/...``) has torch imported already, and gets its threads through ``torch.set_num_threads``
only.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, MutableMapping, Optional, Sequence

THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
SPIN_COUNT = 10_000
# What tune set, and why, as JSON: the launcher's workers read it (their variables are tune's, not the user's),
# and the run's log says it.
DECIDED_VAR = "TORCHTUNE_AC_CPU_THREADS"
SAMPLE_S = 0.06  # one look: about 6 clock ticks a core at Linux's 100 Hz
LOOKS = 5


@dataclass(frozen=True)
class CpuView:
    """What this process may use of the machine, and how busy it is.

    Attributes:
        cores: physical cores among the CPUs this process may run on (its affinity).
        quota: its cgroup's CPU quota in cores (``cpu.max``); None: no quota.
        busy: the share (0 to 1) of those CPUs other processes kept busy while it looked.
    """

    cores: int
    quota: Optional[float] = None
    busy: float = 0.0

    @property
    def usable(self) -> int:
        """The cores this process may keep busy: its cores, within its quota rounded (1.5 cores: 2)."""
        return max(1, min(self.cores, math.floor(self.quota + 0.5))) if self.quota is not None else self.cores


@dataclass(frozen=True)
class ThreadSettings:
    """A run's decision: the variables tune sets, and the user's own it leaves as they are."""

    environment: dict[str, str] = field(default_factory=dict)
    users: dict[str, str] = field(default_factory=dict)
    why: str = ""


def decide_threads(view: CpuView, environ: Mapping[str, str], nproc_per_node: int = 1) -> ThreadSettings:
    """The threads of each of ``nproc_per_node`` processes on a machine seen as ``view``, and OpenMP's spin count;
    every variable of ``THREAD_VARS`` that ``environ`` holds is the user's and stays as it is."""
    users = {name: environ[name] for name in THREAD_VARS if name in environ}
    environment, why = {}, ""
    if "OMP_NUM_THREADS" not in users:
        share = max(1, view.usable // nproc_per_node)
        free = view.usable * (1.0 - view.busy) / nproc_per_node
        threads = max(1, min(share, math.floor(free + 0.5)))
        environment["OMP_NUM_THREADS"] = str(threads)
        if nproc_per_node > 1:
            why = f"{threads} thread(s) for each of {nproc_per_node} processes sharing {view.usable} usable core(s)"
        else:
            why = f"{threads} thread(s) on {view.usable} usable core(s)"
        if threads < share:
            why += f", {view.busy:.0%} of them busy with other processes at start"
    if "OMP_WAIT_POLICY" not in users and "GOMP_SPINCOUNT" not in users:
        environment["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return ThreadSettings(environment, users, why)


def read_cpu_view(sample_s: float = SAMPLE_S, looks: int = LOOKS) -> CpuView:
    """This process's CPUs, its quota, and how busy other processes keep them: the median share of ``looks``
    consecutive looks of ``sample_s`` seconds at ``/proc/stat`` while this process sleeps (``typical_busy``); the
    1-minute load average where there is no ``/proc``."""
    cpus = _affinity()
    return CpuView(cores=_physical_cores(cpus), quota=_cgroup_quota(),
                   busy=typical_busy(_busy_shares(cpus, sample_s, looks)))


def typical_busy(shares: Sequence[float]) -> float:
    """The busy share a run decides by, of several looks: their median (the lower of the two middle ones for an
    even count), so that a burst filling fewer than half of the looks is not taken for load that lasts."""
    ordered = sorted(shares)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def set_thread_defaults(environ: Optional[MutableMapping[str, str]] = None, *, nproc_per_node: int = 1,
                        view: Optional[CpuView] = None) -> Optional[ThreadSettings]:
    """Decide and set the variables of ``decide_threads`` in this process's environment, for libgomp to read when
    torch is imported; with torch imported already, give this process its threads through ``torch.set_num_threads``
    instead (the spin count can no longer change). Does nothing in a worker the launcher decided for.

    Args:
        environ: an environment to decide in instead (nothing else is changed), for ``nproc_per_node`` processes.
        view: the machine, if already seen; None: look (``read_cpu_view``) unless the user chose the threads.

    Returns:
        The decision; None where it was made already.
    """
    env = os.environ if environ is None else environ
    decided = _decided(env)
    if environ is None and (decided.get("pid") == os.getpid() or decided.get("parent") == os.getppid()):
        return None
    # What tune set in another process (a parent that is not this process's launcher) is not the user's.
    users = _users(env, decided)
    measured = view is not None or "OMP_NUM_THREADS" not in users
    view = view or (read_cpu_view() if measured else CpuView(cores=1))
    settings = decide_threads(view, users, nproc_per_node)
    environment = dict(settings.environment)
    if environ is None and "torch" in sys.modules:
        import torch

        environment.pop("GOMP_SPINCOUNT", None)
        if "OMP_NUM_THREADS" in environment:
            torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    env.update(environment)
    record = {"set": environment, "why": settings.why, **({"busy": view.busy} if measured else {})}
    # Decided for this process, or (an environment given: the launcher's) for its children.
    record["pid" if environ is None else "parent"] = os.getpid()
    env[DECIDED_VAR] = json.dumps(record)
    return settings


def worker_environment(environ: Mapping[str, str], nproc_per_node: int) -> dict[str, str]:
    """The variables the launcher (this process, of environment ``environ``) gives each of its
    ``nproc_per_node`` workers: the decision for its share of the cores, the user's own kept."""
    decided = _decided(environ)
    # The machine as the tune command saw it at start, not as it is now that this process has worked.
    view = CpuView(_physical_cores(_affinity()), _cgroup_quota(), decided["busy"]) if "busy" in decided else None
    workers = dict(environ)
    set_thread_defaults(workers, nproc_per_node=nproc_per_node, view=view)
    return {name: value for name, value in workers.items() if environ.get(name) != value}


def describe_threads(environ: Optional[Mapping[str, str]] = None) -> str:
    """One line for the run's log: the variables tune set and why, and the user's own it left as they are."""
    env = os.environ if environ is None else environ
    decided = _decided(env)
    ours = decided.get("set", {})
    users = [f"{name}={value}" for name, value in _users(env, decided).items()]
    parts = []
    if users:
        parts.append(f"{', '.join(users)} from the environment, left as set")
    if ours:
        why = f" ({decided['why']})" if decided.get("why") else ""
        parts.append(f"{', '.join(f'{name}={value}' for name, value in ours.items())} by default{why}")
    return "; ".join(parts) or "OpenMP's defaults"


def _decided(env: Mapping[str, str]) -> dict:
    """What tune recorded in ``env`` (``DECIDED_VAR``); empty where nothing (or something unreadable) is."""
    try:
        decided = json.loads(env.get(DECIDED_VAR, "{}"))
    except ValueError:
        return {}
    return decided if isinstance(decided, dict) else {}


def _users(env: Mapping[str, str], decided: Mapping[str, dict]) -> dict[str, str]:
    """The variables of ``THREAD_VARS`` in ``env`` that tune did not set (as ``decided`` records)."""
    ours = decided.get("set", {})
    return {name: env[name] for name in THREAD_VARS if name in env and ours.get(name) != env[name]}


def _affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _physical_cores(cpus: list[int]) -> int:
    """Physical cores among ``cpus`` (hyperthreads of one core count once, as torch's own default does)."""
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


def _cgroup_quota(root: Path = Path("/")) -> Optional[float]:
    """The CPU quota, in cores, of this process's cgroup (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``) under the file
    system ``root``; None: none."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    cgroups = root / "sys/fs/cgroup"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2; inside a container its own cgroup is the root
            for folder in (cgroups / path.lstrip("/"), cgroups):
                try:
                    quota, period = folder.joinpath("cpu.max").read_text().split()
                except (OSError, ValueError):
                    continue
                return None if quota == "max" else int(quota) / int(period)
        elif "cpu" in controllers.split(","):  # v1
            for folder in (cgroups / "cpu,cpuacct", cgroups / "cpu"):
                try:
                    quota = int(folder.joinpath("cpu.cfs_quota_us").read_text())
                    period = int(folder.joinpath("cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                return None if quota <= 0 else quota / period
    return None


def _busy_shares(cpus: list[int], sample_s: float, looks: int) -> list[float]:
    """The share of ``cpus`` busy in each of ``looks`` consecutive spans of ``sample_s`` seconds (this process
    sleeps meanwhile); without ``/proc``, the 1-minute load average over the machine's CPUs, once."""
    before = _cpu_times(cpus)
    if before is None:
        try:
            return [min(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))]
        except OSError:
            return [0.0]
    shares = []
    for _ in range(looks):
        time.sleep(sample_s)
        after = _cpu_times(cpus)
        if after is None:
            break
        busy, total = after[0] - before[0], after[1] - before[1]
        if total > 0:
            shares.append(min(1.0, max(0.0, busy / total)))
        before = after
    return shares


def _cpu_times(cpus: list[int]) -> Optional[tuple[int, int]]:
    """(busy, total) clock ticks of ``cpus`` since boot; busy counts all but idle and I/O wait (stolen included:
    another machine's work)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{cpu}" for cpu in cpus}
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if name in wanted:
            ticks = [int(value) for value in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None
