"""Keep freed host memory in the process, so a CPU engine step does not fault its buffers in again.

torch's CPU tensors come straight from glibc's malloc, and by default a step's
activations go back to the kernel when freed and are faulted in again, page by page
(each zeroed first), by the next step:
- glibc maps large blocks with mmap and unmaps them on free; its threshold for "large"
  moves with the process's history;
- it returns the free top of a heap to the kernel past a threshold;
- a thread other than the main one allocates from an arena of its own, made of 64 MB
  heaps, and a whole heap that falls free is unmapped.
A worker steps its engine in a thread of its own, so all three apply there.

Measured on 2 cores, bursts of 16 x 128-token prompts, fp32:
- The stack's worker, alternating burst by burst with the same engine in-process:
  it faulted 50k-530k pages per prefill step, and the burst's time to first token
  was 97-1,471 ms longer than the in-process prefill. Under these settings from the
  worker's start: 1-3 faults per step, and 63-179 ms longer (the stack's own hops
  are ~35 ms of that).
- `shardline bench --launch --engine --num-prompts 48 --max-concurrency 16 --rounds 3`:
  the stack added 58.8 ms to TTFT p50 (range +1.5 to +113.5), against +122.0 (+43 to
  +142) just before and +221.7 (+181 to +285) the day before, without them.
- An int8 engine in the main thread: prefill 1081-1221 against 1173-1401 ms (medians of
  3 processes each way; decode steps 31.6-35.7 against 34.6-42.4 ms, within this
  machine's drift).

The settings: one arena for every thread (the main one, which grows by brk and is
never unmapped whole), mmap only for blocks of 1 GB and more, and no trimming.
They hold for sure only when set before the process starts (`MALLOC_ENV`, which
`reexec_with_malloc_env` applies): set later, they reach only threads that have not
allocated yet, and a thread may still pick up an arena another thread left behind
(a worker tuned by mallopt alone still had a 1 GB second arena, and in some runs still
faulted 120k-210k pages per prefill). The cost is that the process keeps its peak heap (a worker's is its largest step's
activations, beside the weights and the KV cache that it keeps anyway), and that
threads share one malloc lock (only the engine thread allocates much).

Setting the trim threshold alone is worse than nothing: it also freezes the mmap
threshold at its 128 KB default, so every buffer above that is mapped and faulted
per use (~2.3M faults and 3x slower steps, measured). Hence nothing unless the mmap
threshold takes; an older glibc that refuses 1 GB gets 32 MB, its largest.

Malloc settings of the user's own (MALLOC_ARENA_MAX, or glibc.malloc tunables in
GLIBC_TUNABLES) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 1 << 30
# Older glibc (before ~2.35) refuses a threshold above half its 64 MB heap size: then this one.
_MMAP_THRESHOLD_FALLBACK = 32 << 20
_TRIM_THRESHOLD = (1 << 31) - 1  # an int: never trim
# The same settings as glibc reads them at process start.
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(_MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(_TRIM_THRESHOLD),
}
# Set beside MALLOC_ENV by the restart: this process's malloc settings are Shardline's, not the user's
# (the stack does not pass them on to its other services, and the worker sets its own).
REEXEC_MARKER = "SHARDLINE_MALLOC_TUNED"


def users_own_malloc_settings() -> bool:
    """The environment chose malloc settings of its own (not ours): leave malloc alone."""
    tunables = "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "")
    return tunables or ("MALLOC_ARENA_MAX" in os.environ and REEXEC_MARKER not in os.environ)


def reexec_with_malloc_env() -> None:
    """Replace this process with itself (same pid, same arguments) started under MALLOC_ENV, unless
    it already runs under them, or the environment sets malloc's arenas or tunables of its own.
    Call it first thing, before threads or large allocations, and only where this process is the
    program (a caller's process would be replaced); on glibc Linux only. If the restart fails, the
    process carries on as it is."""
    if REEXEC_MARKER in os.environ or _mallopt() is None:
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()  # what is buffered would be lost with the old process image
    try:
        os.execve(
            sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **MALLOC_ENV, REEXEC_MARKER: "1"}
        )
    except OSError as exc:
        log.warning("could not restart under %s (%s): host memory is left to malloc's defaults", MALLOC_ENV, exc)


def _mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, where this process may tune malloc: on Linux with glibc, and without malloc
    settings of the environment's own."""
    if not sys.platform.startswith("linux") or users_own_malloc_settings():
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt, and a malloc of their own
        return None


@functools.cache
def keep_freed_host_memory() -> bool:
    """Tune glibc's malloc for this process (see above); False where there is no glibc to tune, or
    the environment chose malloc settings of its own.

    Process-wide: an engine on CPU calls it (RunnerConfig.tune_host_memory). After the restart it
    also repairs an mmap threshold that an older glibc refused from the environment.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) or mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_FALLBACK)):
        log.info("malloc's mmap threshold could not be set: host memory is left to malloc's defaults")
        return False
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    mallopt(_M_ARENA_MAX, 1)
    return True
