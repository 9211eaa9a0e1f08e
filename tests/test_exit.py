"""A job that ends without cleanup() still ends its process group before Python shuts down,
so that gloo's threads cannot abort the process at exit (why: `_end_the_group_at_exit` in
miniddp/job/env.py); unless an exception is ending the process.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.harness.processes import child_env, run_ranks_like_torchrun, tail

# The atexit handler registered first runs last: it sees what is left once MiniDDP's have run.
SCRIPT = """
import atexit, sys
import torch
import torch.distributed as dist
from torch import nn

atexit.register(lambda: print(f"group alive at the very end: {dist.is_initialized()}", flush=True))

from miniddp import MiniDDP, init_distributed

init_distributed()
model = MiniDDP(nn.Linear(4, 1))
for _ in range(3):
    model(torch.randn(8, 4)).sum().backward()
if sys.argv[1] == "raise":
    raise ValueError("the script fails after training")
"""


def run_script(tmp_path: Path, ending: str) -> tuple[int, str]:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), ending]
    return run_ranks_like_torchrun(command, 2, child_env(tmp_path), timeout=120)


def test_a_script_without_cleanup_ends_its_group_at_exit(tmp_path: Path) -> None:
    returncode, output = run_script(tmp_path, "return")
    assert returncode == 0, tail(output)
    assert output.count("group alive at the very end: False") == 2, tail(output)


def test_a_failing_script_leaves_its_group_alone_and_still_ends(tmp_path: Path) -> None:
    """With an exception on its way out, a collective may be in flight: destroying the group
    could wait for it until the timeout, so the group is left to the interpreter."""
    returncode, output = run_script(tmp_path, "raise")
    assert returncode != 0 and "ValueError: the script fails after training" in output
    assert output.count("group alive at the very end: True") == 2, tail(output)


BUSY_RANK_0 = """
import time
from datetime import timedelta
import torch
from torch import nn
import miniddp
from miniddp import MiniDDP, init_distributed

env = init_distributed(timeout=timedelta(seconds=5))  # long enough for a loaded start-up
model = MiniDDP(nn.Linear(4, 1))
for _ in range(5):
    model(torch.randn(8, 4)).sum().backward()
if env.rank == 0:
    time.sleep(11)  # a final evaluation, a save: two timeouts long, and no collective
    print("rank 0 finished its work", flush=True)
miniddp.cleanup()
print(f"rank {env.rank} left", flush=True)
"""


def test_cleanup_waits_for_a_rank_that_is_busy_past_the_timeout(tmp_path: Path) -> None:
    """torch's destroy_process_group() lets rank 1 leave while rank 0 still works; MiniDDP's
    cleanup() waits for it instead (why: miniddp/job/meet.py), and must not call it missing."""
    script = tmp_path / "busy.py"
    script.write_text(BUSY_RANK_0)
    command = [sys.executable, str(script)]
    returncode, output = run_ranks_like_torchrun(command, 2, child_env(tmp_path), timeout=120)
    assert returncode == 0, tail(output)
    assert "rank 0 finished its work" in output and "CollectiveFailed" not in output
    assert "rank 0 left" in output and "rank 1 left" in output, tail(output)
    assert "cleanup() on rank 1: waiting for rank 0" in output, tail(output)


RANK_1_READS_SLOWLY = """
import time
import torch
from torch import nn
import miniddp
from miniddp import MiniDDP, init_distributed
from miniddp.job.notes import Board

env = init_distributed()
model = MiniDDP(nn.Linear(4, 1))
model(torch.randn(8, 4)).sum().backward()
if env.rank == 1:  # rank 1 arrives at cleanup(), then takes a while to read that rank 0 did
    read = Board.arrived_at
    Board.arrived_at = lambda board, rank: time.sleep(1) or read(board, rank)
miniddp.cleanup()
print(f"rank {env.rank} left", flush=True)
"""


def test_rank_0_hosting_the_store_leaves_cleanup_last(tmp_path: Path) -> None:
    """Started without torchrun's agent, rank 0's process holds the store cleanup() meets
    through. Rank 0 sees rank 1 arrive and could exit while rank 1 still reads whether rank 0
    did: rank 1 then failed with "Connection reset by peer" in a healthy job."""
    script = tmp_path / "slow_reader.py"
    script.write_text(RANK_1_READS_SLOWLY)
    command = [sys.executable, str(script)]
    returncode, output = run_ranks_like_torchrun(command, 2, child_env(tmp_path), timeout=120)
    assert returncode == 0, tail(output)
    assert "rank 0 left" in output and "rank 1 left" in output, tail(output)
