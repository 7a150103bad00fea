"""How long this worker process has been alive: its cold start, as the autoscaler plans with it."""

import os
import time
from pathlib import Path


def process_age_s() -> float:
    """Seconds since the kernel started this process; 0.0 where /proc cannot tell.

    Counted from the process's start time rather than from an import, because a CPU worker
    re-executes itself early (shardline/core/host_memory.py): the pid, and its start time, stay the
    same, so the age covers the interpreter's start, the imports and the model load alike.
    """
    try:
        # Fields after the command name, which is in parentheses and may hold spaces: starttime is
        # the 22nd field overall, the 20th after it, in clock ticks since boot.
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0
