"""keep_freed_host_memory: an engine thread's large buffers come from the main heap, never from mmap.

glibc's own report (malloc_info) is read in a child process, whose thread holds a 40 MB
tensor: above the largest mmap threshold glibc picks for itself (32 MB), and allocated
by a thread other than the main one, as a worker's engine thread allocates.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import ctypes, sys, tempfile, threading
    import torch
    from gpu_worker_svc.engine.host_memory import keep_freed_host_memory
    if sys.argv[1] == "tuned":
        assert keep_freed_host_memory()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    report = tempfile.NamedTemporaryFile(suffix=".xml")
    def hold_and_report():
        x = torch.ones(10 << 20)
        stream = libc.fopen(report.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(stream))
        libc.fclose(ctypes.c_void_p(stream))
        del x
    thread = threading.Thread(target=hold_and_report)
    thread.start()
    thread.join()
    print(open(report.name).read())
""")


_TENSOR_BYTES = 40 << 20


def _malloc_info(mode: str) -> tuple[int, int]:
    """(heaps, bytes in blocks mapped on their own) that glibc reports while the child's thread
    holds its tensor. (torch's import maps a few MB before any tuning.)"""
    xml = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True).stdout
    mmapped = re.search(r'<total type="mmap" count="\d+" size="(\d+)"', xml)
    return len(re.findall(r"<heap nr=", xml)), int(mmapped.group(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_buffers_of_a_thread_come_from_the_main_heap() -> None:
    heaps, mmapped = _malloc_info("default")
    assert heaps >= 2 and mmapped >= _TENSOR_BYTES  # the thread's own arena; the tensor mapped, unmapped on free
    heaps, mmapped = _malloc_info("tuned")
    assert heaps == 1 and mmapped < _TENSOR_BYTES  # one arena for every thread, and the tensor from its heap


_REEXEC_CHILD = textwrap.dedent("""
    import os, sys
    from gpu_worker_svc.engine.host_memory import reexec_with_malloc_env
    print("start", os.getpid(), flush=True)
    reexec_with_malloc_env()
    print("running", os.getpid(), os.environ.get("MALLOC_ARENA_MAX"), os.environ.get("MALLOC_TRIM_THRESHOLD_"))
""")


def _reexec(env: dict[str, str]) -> list[list[str]]:
    out = subprocess.run([sys.executable, "-c", _REEXEC_CHILD], capture_output=True, text=True, check=True,
                         env=env).stdout
    return [line.split() for line in out.splitlines()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_reexec_restarts_the_same_process_once_under_the_settings() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    start, again, running = _reexec(env)
    assert start[0] == again[0] == "start" and start[1] == again[1]  # the same pid, started over
    assert running == ["running", start[1], "1", str((1 << 31) - 1)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_reexec_leaves_a_users_own_arena_setting_alone() -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, "MALLOC_ARENA_MAX": "4"}
    start, running = _reexec(env)
    assert running == ["running", start[1], "4", "None"]
