"""Malloc settings that keep a CPU engine step's freed buffers (shardline/core/host_memory.py).

glibc's own report (malloc_info) is read in a child process whose thread holds a 40 MB
tensor: above the largest mmap threshold glibc picks for itself (32 MB), and allocated by
a thread other than the main one, as a worker's engine thread allocates.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from shardline.core.host_memory import MALLOC_ENV, REEXEC_MARKER
from shardline.stack import local_stack as stack

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

_MALLOC_INFO_CHILD = textwrap.dedent("""
    import ctypes, sys, tempfile, threading
    import torch
    from shardline.core.host_memory import keep_freed_host_memory
    if sys.argv[1] == "mallopt":
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


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any malloc settings (the test runner's own, or ours), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("MALLOC_") and k not in (REEXEC_MARKER, "GLIBC_TUNABLES")
    }
    return {**env, **extra}


def _malloc_info(how: str, env: dict[str, str]) -> tuple[int, int]:
    """(heaps, bytes in blocks mapped on their own) that glibc reports while the child's thread
    holds its tensor. (torch's import maps a few MB before any tuning.)"""
    xml = subprocess.run(
        [sys.executable, "-c", _MALLOC_INFO_CHILD, how], capture_output=True, text=True, check=True, env=env
    ).stdout
    mmapped = re.search(r'<total type="mmap" count="\d+" size="(\d+)"', xml)
    return len(re.findall(r"<heap nr=", xml)), int(mmapped.group(1))


def test_a_threads_large_buffers_come_from_the_main_heap_once_tuned() -> None:
    heaps, mmapped = _malloc_info("default", _clean_env())
    assert heaps >= 2 and mmapped >= _TENSOR_BYTES  # the thread's own arena; the tensor mapped, unmapped on free
    for how, env in (("mallopt", _clean_env()), ("environment", _clean_env(**MALLOC_ENV))):
        heaps, mmapped = _malloc_info(how, env)
        assert heaps == 1 and mmapped < _TENSOR_BYTES, how  # one arena for every thread; the tensor from its heap


_REEXEC_CHILD = textwrap.dedent("""
    import os, sys
    from shardline.core.host_memory import keep_freed_host_memory, reexec_with_malloc_env
    print("start", os.getpid(), flush=True)
    reexec_with_malloc_env()
    env = os.environ
    print("running", os.getpid(), env.get("MALLOC_ARENA_MAX"), env.get("MALLOC_TRIM_THRESHOLD_"),
          env.get("SHARDLINE_MALLOC_TUNED"), keep_freed_host_memory())
""")


def _reexec(env: dict[str, str]) -> list[list[str]]:
    out = subprocess.run(
        [sys.executable, "-c", _REEXEC_CHILD], capture_output=True, text=True, check=True, env=env
    ).stdout
    return [line.split() for line in out.splitlines()]


def test_reexec_restarts_the_same_process_once_under_the_settings() -> None:
    start, again, running = _reexec(_clean_env())
    assert start[0] == again[0] == "start" and start[1] == again[1]  # the same pid, started over
    assert running == ["running", start[1], "1", str((1 << 31) - 1), "1", "True"]


@pytest.mark.parametrize("own", [{"MALLOC_ARENA_MAX": "4"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}])
def test_a_users_own_malloc_settings_are_left_alone(own: dict[str, str]) -> None:
    start, running = _reexec(_clean_env(**own))
    assert running == ["running", start[1], own.get("MALLOC_ARENA_MAX", "None"), "None", "None", "False"]


def test_the_stack_passes_on_the_users_malloc_settings_but_not_ours(monkeypatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    monkeypatch.delenv(REEXEC_MARKER, raising=False)
    assert stack._own_environ()["MALLOC_ARENA_MAX"] == "4"
    for key, value in {**MALLOC_ENV, REEXEC_MARKER: "1"}.items():
        monkeypatch.setenv(key, value)
    assert not set(stack._own_environ()) & {*MALLOC_ENV, REEXEC_MARKER}
