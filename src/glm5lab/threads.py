"""How many CPU threads torch uses, decided before torch is imported (docs/threads.md).

torch's CPU kernels run on libgomp (GNU OpenMP; checked: `torch/lib/libgomp.so.1`, not Intel's libiomp, so
KMP_BLOCKTIME does not apply). libgomp's threads spin-wait at every barrier (OMP_WAIT_POLICY ACTIVE by default).
When another process takes one of the cores, the thread that is descheduled holds up every barrier and the others
spin meanwhile; a small model's many small ops cross thousands of barriers a second, so two threads beside one
busy process ran `glm5lab generate` 5x slower and `glm5lab train` 3x+ slower than one thread (docs/threads.md).

The policy (`choose_threads`), in order:
1. `--threads N` wins over everything (it also overrides OMP_NUM_THREADS);
2. OMP_NUM_THREADS set by the user (torchrun sets it to 1 itself for several processes per
   node) is left to torch;
3. under torchrun (LOCAL_WORLD_SIZE > 1): usable CPUs // processes per node, at least 1;
4. otherwise one thread per CPU that other processes leave free: usable CPUs minus the CPUs
   they keep busy (`busy_cpus`, rounded), at least 1.
OMP_WAIT_POLICY is left as the user set it (default ACTIVE): PASSIVE made decoding 3x slower on
a quiet machine, and one thread beat two PASSIVE ones beside a busy process.

The busy CPUs come from /proc/stat sampled over `SAMPLE_S` seconds while this process sleeps, not from the load
average: the 1-minute load average lags a new busy process by a minute and counts our own previous command for a
minute after it ended (it read 1.0-1.4 between runs on an otherwise quiet machine). For tests and for machines
without /proc/stat, the environment variable GLM5LAB_BUSY_CPUS (a number of CPUs, e.g. "1.0") replaces the sample.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

SAMPLE_S = 0.1
"""Seconds of /proc/stat sampling (10 clock ticks of 10 ms per CPU: busy CPUs to +-0.1)."""
BUSY_ENV = "GLM5LAB_BUSY_CPUS"
COMPUTE_COMMANDS = ("train", "generate", "ablate", "report", "eval")
"""The CLI commands that take --threads and get this policy (glm5lab.cli.main)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_threads(text: str, cpus: int | None = None) -> int:
    """`--threads N` (an argparse type): an int in 1..cpus (default: `usable_cpus()`; more threads
    than CPUs only adds the contention the flag is for). Raises argparse.ArgumentTypeError naming
    the value and the allowed range (argparse prefixes `argument --threads:` and exits with 2)."""
    cpus = cpus or usable_cpus()
    n = int(text) if text.strip().lstrip("+-").isdigit() else None
    if n is None or not 1 <= n <= cpus:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: a whole number from 1 to {cpus} (this "
                                         "machine's usable CPUs)")
    return n


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    return total - idle, total


def busy_cpus(cpus: int | None = None, sample_s: float = SAMPLE_S) -> float | None:
    """CPUs kept busy by other processes now: GLM5LAB_BUSY_CPUS if set, else the busy share of all CPUs' ticks
    over `sample_s` seconds of sleeping, times `cpus` (default usable_cpus()); None where /proc/stat cannot be
    read. Raises ValueError for a GLM5LAB_BUSY_CPUS that is not a finite number >= 0."""
    if os.environ.get(BUSY_ENV):
        text = os.environ[BUSY_ENV]
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{BUSY_ENV}={text!r} is not allowed: a number of busy CPUs >= 0 (e.g. 1.0), or unset it")
        return value
    try:
        b0, t0 = _cpu_ticks()
        time.sleep(sample_s)
        b1, t1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(t1 - t0, 1) * (cpus or usable_cpus())


def choose_threads(*, requested: int | None, env: dict, cpus: int, busy: float | None) -> tuple[int | None, str]:
    """(torch threads, why) by the policy in the module docstring; None = leave torch's own
    choice (OMP_NUM_THREADS from the user). `env`: the process environment (OMP_NUM_THREADS,
    LOCAL_WORLD_SIZE); `busy`: CPUs other processes keep busy (None: unknown, taken as 0)."""
    if requested is not None:
        return requested, "--threads"
    if _positive_int(env.get("OMP_NUM_THREADS")):  # an invalid value (libgomp ignores it) counts as unset
        return None, "OMP_NUM_THREADS"
    local_world = _positive_int(env.get("LOCAL_WORLD_SIZE")) or 1
    if local_world > 1:
        return max(1, cpus // local_world), f"{local_world} processes per node"
    taken = int((busy or 0.0) + 0.5)
    return max(1, cpus - taken), "load"


def _positive_int(text: str | None) -> int | None:
    """int(text) when it is a whole number >= 1, else None."""
    return int(text) if text and text.strip().isdigit() and int(text) >= 1 else None


def notice(command: str, threads: int, cpus: int, busy: float) -> str:
    """The one stderr line printed when other processes keep CPUs busy and the policy used fewer
    threads than CPUs."""
    return (f"glm5lab {command}: other processes keep {busy:.1f} of {cpus} CPUs busy; using {threads} torch "
            f"thread{'s' if threads > 1 else ''} (OpenMP threads spin-wait when one is descheduled: "
            "docs/threads.md); override with --threads N")


def configure(command: str, requested: int | None) -> int | None:
    """Apply the policy for `command` before its body runs; returns the thread count set (None:
    left to torch). Before torch is imported it sets OMP_NUM_THREADS (libgomp and MKL read it at load); once
    torch is imported (main() called from Python), only `requested` takes effect, through
    torch.set_num_threads. Prints `notice` on stderr when the load made it use fewer threads than CPUs."""
    imported = "torch" in sys.modules
    if imported and requested is None:
        return None
    cpus, env = usable_cpus(), dict(os.environ)
    threads, why = choose_threads(requested=requested, env=env, cpus=cpus, busy=None)
    if why == "load":  # sampled only where the policy reads it (0.1 s)
        busy = busy_cpus(cpus)
        threads, why = choose_threads(requested=requested, env=env, cpus=cpus, busy=busy)
    if threads is None:
        return None
    if imported:
        import torch

        torch.set_num_threads(threads)
    else:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if why == "load" and threads < cpus:
        print(notice(command, threads, cpus, busy), file=sys.stderr)
    return threads
