"""`./launch.sh --emulate-nodes 2` runs a 2-node job on this machine, and cleans up after itself.

Network namespaces where this machine allows them (root, `ip netns`), loopback otherwise: the
launcher decides, says which, and these tests check what it said. The tests that only make sense
with namespaces (the link cap) are skipped without them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.harness.processes import child_env, tail

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240
STOP_GRACE_S = 30  # after SIGINT/SIGTERM, the launcher stops torchrun and removes namespaces
LAUNCH_VARIABLES = ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
SAID_NAMESPACES = "in network namespaces"
SAID_LOOPBACK = "on loopback, without network namespaces"

# A tiny job: every rank reports its names, then rank 0 times one all-reduce of 4 MB.
HELLO = """
import os, time, torch, torch.distributed as dist
from miniddp.job.env import init_distributed
env = init_distributed()
print(f"hello RANK={env.rank} GROUP_RANK={env.node_rank} WORLD_SIZE={env.world_size}", flush=True)
tensor = torch.ones(1_000_000)
dist.all_reduce(tensor)
start = time.perf_counter()
dist.all_reduce(tensor)
if env.rank == 0:
    print(f"all-reduce seconds {time.perf_counter() - start:.3f}", flush=True)
if os.environ.get("SLEEP_AFTER_S"):
    print("ready", flush=True)
    time.sleep(float(os.environ["SLEEP_AFTER_S"]))
dist.destroy_process_group()
"""

# The last rank exits abruptly at step 3; the others should name it, not hang.
LOSE_A_RANK = """
import os, torch, torch.distributed as dist
from datetime import timedelta
from miniddp.job.env import init_distributed
from miniddp.job.faults import CollectiveFailed, wait_for
env = init_distributed(timeout=timedelta(seconds=20))
try:
    for step in range(6):
        if step == 3 and env.rank == env.world_size - 1:
            os._exit(1)
        work = dist.all_reduce(torch.ones(1000), async_op=True)
        wait_for(work.get_future(), f"all-reduce of step {step}")
except CollectiveFailed as error:
    print(f"rank {env.rank} raised CollectiveFailed: {error}", flush=True)
    os._exit(3)
"""


def namespaces_work() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"mddp-test-probe-{os.getpid()}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if added:
        subprocess.run(["ip", "netns", "delete", probe], check=True)
    return added


NAMESPACES = namespaces_work()


def launch(args: list[str], tmp_path: Path, **extra_env: str) -> subprocess.Popen:
    env = child_env(tmp_path, drop=LAUNCH_VARIABLES, **extra_env)
    return subprocess.Popen(
        ["./launch.sh", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # our signals only, not the terminal's
        # A shell started in the background hands its children SIGINT ignored, and bash cannot
        # trap a signal ignored on entry: give the launcher Ctrl-C back, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def finish(launcher: subprocess.Popen, timeout: float = TIMEOUT_S) -> str:
    """Wait for the launcher; on timeout, stop it the way a user would, then by force."""
    try:
        output, _ = launcher.communicate(timeout=timeout)
        return output
    except subprocess.TimeoutExpired:
        launcher.send_signal(signal.SIGTERM)
        try:
            output, _ = launcher.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            output, _ = launcher.communicate()
        pytest.fail(f"timed out after {timeout} s:\n{tail(output)}")
    finally:
        leftovers = our_namespaces(launcher.pid)
        remove_namespaces(leftovers)
        assert not leftovers, f"the launcher left namespaces behind: {leftovers}"


def our_namespaces(launcher_pid: int) -> list[str]:
    if shutil.which("ip") is None:
        return []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return re.findall(rf"^(mddp-{launcher_pid}-\S+)", listing, flags=re.MULTILINE)


def remove_namespaces(names: list[str]) -> None:
    for name in names:
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def check_network_said(output: str) -> None:
    """The launcher used namespaces exactly when this machine allows them, and said so."""
    said = (SAID_NAMESPACES in output, SAID_LOOPBACK in output)
    assert said == (NAMESPACES, not NAMESPACES), tail(output)


def write_script(tmp_path: Path, text: str = HELLO, name: str = "hello.py") -> str:
    script = tmp_path / name
    script.write_text(text)
    return str(script)


@pytest.mark.slow  # 29 s; the default suite launches two emulated nodes below (a lost rank)
def test_chapter_07_runs_on_two_emulated_nodes(tmp_path: Path) -> None:
    launcher = launch(["--emulate-nodes", "2", "tutorials/07_multinode.py"], tmp_path)
    output = finish(launcher)
    assert launcher.returncode == 0, f"exited with {launcher.returncode}:\n{tail(output)}"
    check_network_said(output)
    assert "Verified on 4 ranks over 2 node(s)" in output, tail(output)
    if NAMESPACES:
        assert "10.213.7.1" in output and "10.213.7.2" in output
        assert "Each node talks from its own address" in output


@pytest.mark.slow  # 10 s; the namespace launch above goes through the same launcher
def test_loopback_fallback_can_be_forced(tmp_path: Path) -> None:
    args = ["--emulate-nodes", "2", "--loopback", write_script(tmp_path)]
    launcher = launch(args, tmp_path, NPROC="1")
    output = finish(launcher)
    assert launcher.returncode == 0, f"exited with {launcher.returncode}:\n{tail(output)}"
    assert "--loopback was given" in output and SAID_NAMESPACES not in output
    assert "GLOO_SOCKET_IFNAME=lo" in output
    for rank in (0, 1):
        assert f"hello RANK={rank} GROUP_RANK={rank} WORLD_SIZE=2" in output, tail(output)


@pytest.mark.slow  # 12 s; tests/test_link.py checks the simulated link's arithmetic
@pytest.mark.skipif(not NAMESPACES, reason="needs root and working `ip netns`")
def test_link_rate_caps_the_bandwidth_between_nodes(tmp_path: Path) -> None:
    args = ["--emulate-nodes", "2", "--link-rate", "40mbit", write_script(tmp_path)]
    launcher = launch(args, tmp_path, NPROC="1")
    output = finish(launcher)
    assert launcher.returncode == 0, f"exited with {launcher.returncode}:\n{tail(output)}"
    assert "capped at 40mbit" in output
    seconds = float(re.search(r"all-reduce seconds (\S+)", output).group(1))
    # Two ranks all-reducing 4 MB each send 4 MB in all (half for the reduce-scatter, half for
    # the all-gather): at 40 Mbit/s = 5 MB/s that takes 0.8 s, and no burst can beat the cap
    # for long.
    assert seconds > 0.5, f"4 MB crossed a 40mbit link in {seconds} s"


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],  # one is enough here
    ids=["SIGINT", "SIGTERM"],
)
def test_an_interrupted_launch_stops_everything_and_removes_its_namespaces(
    tmp_path: Path, sig: signal.Signals
) -> None:
    launcher = launch(
        ["--emulate-nodes", "2", write_script(tmp_path)], tmp_path, NPROC="1", SLEEP_AFTER_S="600"
    )
    lines = []
    watchdog = threading.Timer(TIMEOUT_S, launcher.terminate)  # if "ready" never comes
    watchdog.start()
    for line in launcher.stdout:  # wait until the job is really running
        lines.append(line)
        if line.startswith("ready"):
            break
    watchdog.cancel()
    assert any(line.startswith("ready") for line in lines), "".join(lines)
    if NAMESPACES:
        assert len(our_namespaces(launcher.pid)) == 2
    launcher.send_signal(sig)  # what Ctrl-C (or `kill`) does to the launcher
    started = time.monotonic()
    output = "".join(lines) + finish(launcher, timeout=STOP_GRACE_S)
    assert launcher.returncode == 128 + sig, tail(output)
    assert "stopping the nodes" in output
    assert time.monotonic() - started < STOP_GRACE_S
    assert not hello_processes(tmp_path), "workers survived the launcher"


def test_a_rank_lost_on_one_node_is_named_on_the_other(tmp_path: Path) -> None:
    script = write_script(tmp_path, LOSE_A_RANK, "lose_a_rank.py")
    launcher = launch(["--emulate-nodes", "2", script], tmp_path, NPROC="1")
    output = finish(launcher)
    assert launcher.returncode != 0
    # Node 1's agent reports its worker's death; node 0 gets time to say what it saw.
    assert "rank 0 raised CollectiveFailed: all-reduce of step 3" in output, tail(output)
    assert "rank 1 is missing" in output and "the other nodes get" in output


def hello_processes(tmp_path: Path) -> list[int]:
    """Processes still running this test's script (workers, or agents that start them)."""
    script = str(tmp_path / "hello.py").encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if script in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile, or not ours to read
    return found


def test_help_documents_the_emulation_and_bad_options_are_refused(tmp_path: Path) -> None:
    output = finish(launch(["--help"], tmp_path), timeout=30)
    assert "--emulate-nodes N" in output and "--link-rate RATE" in output
    assert "--loopback" in output and "scripts/emulate_nodes.sh" in output
    for args in (["--emulate-nodes", "1", "x.py"], ["--link-rate", "1mbit", "x.py"], ["--nope"]):
        launcher = launch(args, tmp_path)
        output = finish(launcher, timeout=30)
        assert launcher.returncode == 2 and "see ./launch.sh --help" in output, (args, output)
