"""A process that burns a core while a test runs: the busy machine users train on.

`cpu_hog()` starts plain Python processes spinning in a loop and stops exactly those, by PID,
when the block ends (also when the test fails), so nothing outlives the test.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "while True: pass"


@contextmanager
def cpu_hog(processes: int = 1) -> Iterator[list[int]]:
    """Run `processes` busy loops for the duration of the block; yield their PIDs."""
    hogs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(processes)]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
