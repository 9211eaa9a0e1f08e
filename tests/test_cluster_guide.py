"""The cluster guide's files (docs/cluster/) parse, agree with each other, and launch the way
chapter 07's emulated two-node run does.

No cluster here, so: the shell files pass `bash -n`; the Kubernetes manifest parses and its names
line up (Service, pod names, rendezvous endpoint, node count); every launch uses the emulation's
torchrun rendezvous options; and the two-VM script, pointed at this machine's loopback, really
runs a two-node job of the template.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.harness.processes import child_env, run_in_own_session, tail

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "cluster"
EMULATION = REPO / "scripts" / "emulate_nodes.sh"
SHELL_FILES = [GUIDE / "two_vms.sh", GUIDE / "train.sbatch"]
MANIFEST = GUIDE / "kubernetes.yaml"
# Only the emulation and the two VMs must say which address is theirs and which node hosts the
# store: there the hostname may resolve to 127.0.0.1. SLURM and Kubernetes name nodes in DNS.
NAMES_ITS_ADDRESS = {"--local_addr", "--rdzv_conf"}
RESTARTS = {"--max-restarts"}  # the guide's launches restart workers; the emulation does not
TIMEOUT_S = 240


def torchrun_options_in_shell(path: Path) -> dict[str, str]:
    """The options of the `torchrun ... "$@"` command in a shell file: {"--name": "value"}."""
    text = path.read_text().replace("\\\n", " ")  # join continued lines
    match = re.search(r'\btorchrun(\s+--.*?)"\$@"', text, re.DOTALL)
    assert match, f'no torchrun ... "$@" command in {path}'
    return dict(token.partition("=")[::2] for token in shlex.split(match.group(1)))


def kubernetes_objects() -> dict[str, dict]:
    yaml = pytest.importorskip("yaml")
    return {obj["kind"]: obj for obj in yaml.safe_load_all(MANIFEST.read_text())}


def torchrun_options_in_manifest() -> dict[str, str]:
    container = kubernetes_objects()["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    script = next(i for i, arg in enumerate(args) if not arg.startswith("--"))
    return dict(arg.partition("=")[::2] for arg in args[:script])


@pytest.mark.parametrize("path", SHELL_FILES, ids=[p.name for p in SHELL_FILES])
def test_shell_files_parse(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


LAUNCHES = {
    "two VMs": lambda: torchrun_options_in_shell(GUIDE / "two_vms.sh"),
    "SLURM": lambda: torchrun_options_in_shell(GUIDE / "train.sbatch"),
    "Kubernetes": lambda: torchrun_options_in_manifest(),
}


@pytest.mark.parametrize("launch", LAUNCHES)
def test_launch_uses_the_emulations_rendezvous(launch: str) -> None:
    emulated, options = torchrun_options_in_shell(EMULATION), LAUNCHES[launch]()
    expected = set(emulated) | RESTARTS
    if launch != "two VMs":
        expected -= NAMES_ITS_ADDRESS
    assert set(options) == expected
    assert options["--rdzv_backend"] == emulated["--rdzv_backend"] == "c10d"


def test_every_launch_gives_restarted_workers_a_fresh_store() -> None:
    setting = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"
    assert setting in EMULATION.read_text()
    for path in SHELL_FILES:
        assert f"export {setting}" in path.read_text(), path.name
    container = kubernetes_objects()["Job"]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]


def test_kubernetes_names_line_up() -> None:
    objects = kubernetes_objects()
    service, job = objects["Service"], objects["Job"]
    pod = job["spec"]["template"]["spec"]
    options = torchrun_options_in_manifest()
    assert service["spec"]["clusterIP"] == "None"  # headless: one DNS name per pod
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert job["spec"]["completionMode"] == "Indexed"  # pods named <job>-<index>
    nodes = int(options["--nnodes"])
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == nodes
    endpoint_host, port = options["--rdzv_endpoint"].split(":")
    assert endpoint_host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    container = pod["containers"][0]
    assert container["ports"] == [{"containerPort": int(port)}]
    assert int(options["--nproc_per_node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if v.get("persistentVolumeClaim")
    ]
    assert claims == [objects["PersistentVolumeClaim"]["metadata"]["name"]]


def test_the_guide_names_every_file() -> None:
    guide = (REPO / "docs" / "cluster.md").read_text()
    for path in GUIDE.iterdir():
        assert f"cluster/{path.name}" in guide, path.name


@pytest.mark.skipif(shutil.which("ip") is None, reason="two_vms.sh needs the ip command")
@pytest.mark.slow  # 9 s; the emulated nodes of tests/test_multinode.py run the same launch
def test_two_vm_script_runs_a_two_node_job_on_loopback(tmp_path: Path) -> None:
    """Both "VMs" here, at 127.0.0.1: the script finds the address and interface (lo) itself."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    checkpoint = tmp_path / "last.pt"
    command = [
        str(GUIDE / "two_vms.sh"),
        "tutorials/08_template.py",
        "--epochs=1",
        f"--checkpoint={checkpoint}",
    ]

    def node_env(node: int) -> dict[str, str]:
        return child_env(
            tmp_path,
            NODE_RANK=str(node),
            NODE0_ADDR="127.0.0.1",
            NPROC="1",
            RDZV_PORT=str(port),
            RDZV_ID=f"test-{port}",
        )

    # VM 0 in the background (its own session, so all of it can be killed), VM 1 in the
    # foreground; each alone would wait for the other until the rendezvous timeout.
    vm0 = subprocess.Popen(
        command,
        cwd=REPO,
        env=node_env(0),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        vm1_returncode, vm1_output = run_in_own_session(command, node_env(1), TIMEOUT_S)
        vm0_output, _ = vm0.communicate(timeout=30)
    finally:
        if vm0.poll() is None:
            os.killpg(vm0.pid, signal.SIGKILL)
    outputs = f"VM 0:\n{tail(vm0_output)}\nVM 1:\n{tail(vm1_output)}"
    assert vm0.returncode == 0 and vm1_returncode == 0, outputs
    assert "--local_addr=127.0.0.1 --rdzv_conf=is_host=true" in vm0_output, outputs
    assert "GLOO_SOCKET_IFNAME=lo" in vm1_output, outputs
    assert "replicas identical on 2 ranks" in vm0_output + vm1_output, outputs
    assert checkpoint.exists()
