"""What scripts/gpu_check.sh runs: every parallelism against torch's own on this machine's GPUs,
in one prepared run, ending in a one-screen table. A lent GPU is held for minutes, so everything
is found in one go, and the whole run fits in 8 minutes on one 8-GPU node.

    1. scripts/parallelism_checks.py's checks under torchrun (scripts/run_checks.py), one rank
       per GPU, over NCCL: DDP, ZeRO, FSDP, TP, PP, CP, the 3-D composition and the send/recv
       collectives, each against torch's own or one process. On one GPU, W = 2 over gloo with
       CUDA tensors, both ranks on the same GPU (NCCL refuses two ranks on one GPU). Our messages
       go through a host copy there (gloo's send/recv read host memory only); torch's pipelining
       sends GPU tensors as they are, so its checks are skipped (docs/cpu_assumptions.md).
    2. `pytest -m cuda tests/test_cuda.py`: MiniDDP over NCCL at W = 1 and over gloo with CUDA
       tensors at W = 2.
    3. the step benchmark on cuda, MiniDDP against torch's DDP, for its figures.

    scripts/gpu_check.sh             on a machine with GPUs; exit status 0 when all passed
    scripts/gpu_check.sh --dry-run   what it would run here (or --gpus N: on N GPUs); no GPU
    scripts/gpu_check.sh --cpu       the same checks on the CPU over gloo at W = 2 (step 1)

A check that crashes its ranks or hangs past the process-group timeout is reported and the
others go on: torchrun is started again on the checks not yet run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from parallelism_checks import CHECKS, mesh_shape  # noqa: E402
from run_checks import STOPPING  # noqa: E402

BUDGET_S = 8 * 60  # the whole run, on one 8-GPU node
PYTEST_TIMEOUT_S = 150
BENCH_TIMEOUT_S = 90
PYTEST_ROWS = {
    "test_miniddp_on_one_rank_over_the_devices_backend_matches_torch_ddp": "MiniDDP on W = 1",
    "test_miniddp_on_two_ranks_over_gloo_matches_torch_ddp": "MiniDDP on W = 2, gloo+CUDA",
    "test_send_recv_collectives_match_torch": "send/recv collectives, gloo+CUDA",
    "test_the_pipeline_sends_cuda_tensors_over_gloo": "pipeline's sends, gloo+CUDA",
}


@dataclass(frozen=True)
class Plan:
    """Where the checks run: `world_size` ranks on `device`, over `backend`."""

    device: str  # "cpu" or "cuda"
    backend: str
    world_size: int
    gpus: int
    machine: str

    @property
    def host_memory_sends(self) -> bool:
        return self.device == "cuda" and self.backend == "gloo"

    @property
    def backend_label(self) -> str:
        return f"{self.backend}+cuda" if self.host_memory_sends else self.backend

    def torchrun(self, out: Path, checks: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={self.world_size}",
            "scripts/run_checks.py",
            f"--device={self.device}",
            f"--backend={self.backend}",
            f"--out={out}",
            *checks,
        ]

    def pytest(self, logs: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "cuda",
            "-k",
            "not benchmark",
            "tests/test_cuda.py",
            f"--junitxml={logs / 'tests.xml'}",
        ]

    def bench(self, logs: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "miniddp.bench",
            "step",
            "--device=cuda",
            "--models=mlp",
            "--variants=miniddp,torch",
            "--iters=20",
            "--trace-iters=2",
            f"--json={logs / 'bench.json'}",
        ]


def plan_for(cpu: bool, gpus: int | None = None, machine: str | None = None) -> Plan:
    """W = the GPU count over NCCL; one GPU: W = 2 over gloo on it; `cpu`: W = 2 over gloo."""
    if cpu:
        return Plan("cpu", "gloo", 2, 0, "cpu")
    if gpus is None:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(
                f"gpu_check: no CUDA device: torch {torch.__version__} (built for CUDA "
                f"{torch.version.cuda}) sees no GPU; run it on a machine with an NVIDIA GPU, or "
                "--dry-run or --cpu here"
            )
        gpus, machine = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    machine = f"{gpus} x {machine or 'GPU'}"
    if gpus == 1:
        return Plan("cuda", "gloo", 2, 1, machine)
    return Plan("cuda", "nccl", gpus, gpus, machine)


def skipped(plan: Plan) -> dict[str, str]:
    if not plan.host_memory_sends:
        return {}
    reason = "skipped: torch's side sends GPU tensors by gloo's send/recv (host memory only)"
    return {name: reason for name, check in CHECKS.items() if check.torch_sends}


def dry_run(plan: Plan) -> None:
    def show(command: list[str]) -> str:
        return shlex.join(["python3" if part == sys.executable else part for part in command])

    logs, world = Path("LOGS"), plan.world_size
    print(f"gpu_check --dry-run: on {plan.machine}, W = {world} over {plan.backend_label}")
    if plan.gpus == 1:
        print("  (one GPU: NCCL refuses two ranks on one GPU, so both share it over gloo)")
    print(
        f"\n1. the parallelism checks, in one torchrun (W = {world}; a 3-D mesh (pp, dp, tp) "
        f"= {mesh_shape(world)}):\n   {show(plan.torchrun(logs, []))}"
    )
    leave_out = skipped(plan)
    for name, check in CHECKS.items():
        print(f"   {check.parallelism:<12} {name}", *[leave_out[name]] if name in leave_out else [])
    if plan.device == "cuda":
        print(f"\n2. the CUDA tests:\n   {show(plan.pytest(logs))}")
        for row in PYTEST_ROWS.values():
            print(f"   {'test_cuda':<12} {row}")
        print(f"\n3. the step benchmark:\n   {show(plan.bench(logs))}")
    print(f"\nall within {BUDGET_S // 60} minutes; logs in a new folder that the table names")


def run(command: list[str], log: Path, timeout: float) -> int | None:
    """Run `command` in its own session, its output to `log`; None when it ran out of time
    (then its whole process group is killed: torchrun's workers too)."""
    env = os.environ | {
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    with log.open("a") as output:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return process.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None


def parallelism_rows(plan: Plan, logs: Path, deadline: float) -> list[dict]:
    """Run the checks under torchrun until each has a row; start torchrun again after a check
    that raised (the ranks stop: their group may be out of step) or that killed its ranks."""
    rows = {
        name: {
            "check": name,
            "parallelism": CHECKS[name].parallelism,
            "status": "skipped",
            "note": reason,
        }
        for name, reason in skipped(plan).items()
    }
    remaining = [name for name in CHECKS if name not in rows]
    attempt = 0
    while remaining:
        attempt += 1
        out = logs / f"checks{attempt}"
        out.mkdir()
        code = run(plan.torchrun(out, remaining), logs / "checks.log", deadline - time.time())
        for rank_log in sorted(out.glob("rank*.jsonl")):
            for line in rank_log.read_text().splitlines():
                row = json.loads(line)
                rows.setdefault(row["check"], row)
        done = [name for name in remaining if name in rows]
        remaining = [name for name in remaining if name not in rows]
        if not remaining:
            break
        # the ranks stop after a check that raised (torchrun then exits 1): start them again
        stopped_after_error = bool(done) and rows[done[-1]]["status"] in STOPPING
        if code is None or not stopped_after_error:
            lost = remaining.pop(0)  # it killed its ranks, or outlived the run's budget
            why = "out of time" if code is None else f"torchrun exited {code}"
            rows[lost] = {
                "check": lost,
                "parallelism": CHECKS[lost].parallelism,
                "status": "CRASHED",
                "note": f"{why} (logs: checks.log)",
            }
        if code is None:
            for name in remaining:
                rows[name] = {
                    "check": name,
                    "parallelism": CHECKS[name].parallelism,
                    "status": "not run",
                    "note": "no time left",
                }
            break
    return [rows[name] for name in CHECKS]


def pytest_rows(plan: Plan, logs: Path) -> list[dict]:
    code = run(plan.pytest(logs), logs / "tests.log", PYTEST_TIMEOUT_S)
    missing = "timed out" if code is None else "see tests.log"
    report = logs / "tests.xml"
    return junit_rows(report.read_text() if report.exists() else None, missing)


def junit_rows(report: str | None, missing: str) -> list[dict]:
    """A row for each of PYTEST_ROWS' tests from pytest's junit `report`: ok, FAIL, skipped,
    or xfail (an expected failure: tests/test_cuda.py says why); `missing` where it has none."""
    rows = {
        name: {"check": name, "parallelism": "test_cuda", "status": "not run", "note": missing}
        for name in PYTEST_ROWS.values()
    }
    for case in ElementTree.fromstring(report).iter("testcase") if report else []:
        name = PYTEST_ROWS.get(case.get("name", "").split("[")[0])
        if name is None:
            continue
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            status, said = "FAIL", failed.get("message")
        elif skipped is not None:
            status = "xfail" if skipped.get("type") == "pytest.xfail" else "skipped"
            said = skipped.get("message")
        else:
            status, said = "ok", ""
        rows[name] |= {"status": status, "note": (said or "").split("\n")[0][:60]}
    return list(rows.values())


def bench_row(plan: Plan, logs: Path) -> dict:
    code = run(plan.bench(logs), logs / "bench.log", BENCH_TIMEOUT_S)
    row = {"check": "step benchmark, mlp", "parallelism": "bench", "status": "FAIL"}
    try:
        figures = json.loads((logs / "bench.json").read_text())["results"][0]["rows"]
        mine, theirs = figures["miniddp"], figures["torch"]
        return row | {
            "status": "ok",
            "note": f"miniddp {mine['median_ms']:.2f} ms, torch "
            f"{theirs['median_ms']:.2f} ms: {mine['vs_reference']:.2f}x",
        }
    except (OSError, KeyError, IndexError, ValueError):
        return row | {"note": "timed out" if code is None else "see bench.log"}


PASSING = ("ok", "skipped", "xfail")


def table(rows: list[dict], plan: Plan) -> str:
    """One screen: a line a row, the difference beside the bound it had to stay within."""
    lines = [
        f"{'':<12} {'check':<52} {'W':>2} {'backend':<9} {'s':>4} {'result':<7} max difference"
    ]
    for row in rows:
        world = plan.world_size if row["parallelism"] not in ("test_cuda", "bench") else ""
        backend = plan.backend_label if world else ""
        if "difference" in row:
            bound = "bitwise" if row["bound"] == 0 else f"<= {row['bound']:.1e}"
            detail = f"{row['difference']:.1e} ({bound})"
            detail += f", {row['note']}" if row.get("note") else ""
        else:
            detail = row.get("note", "")
        seconds = f"{row['seconds']:.0f}" if "seconds" in row else ""
        lines.append(
            f"{row['parallelism']:<12} {row['check']:<52} {world!s:>2} {backend:<9} "
            f"{seconds:>4} {row['status']:<7} {detail}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list what would run; no GPU")
    parser.add_argument("--cpu", action="store_true", help="the checks on CPU, gloo, W = 2")
    parser.add_argument("--gpus", type=int, help="with --dry-run: the plan for N GPUs")
    args = parser.parse_args(argv)
    machine = None
    if args.gpus is not None and not args.dry_run:
        parser.error("--gpus only goes with --dry-run: a real run uses the GPUs it finds")
    if args.dry_run and not args.cpu and args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count() or 8  # no GPU here: one 8-GPU node's plan
        if not torch.cuda.is_available():
            machine = "GPU (none here: the plan for one 8-GPU node; --gpus N for N)"
    plan = plan_for(args.cpu, args.gpus, machine)
    if args.dry_run:
        dry_run(plan)
        return 0
    start = time.time()
    logs = Path(tempfile.mkdtemp(prefix="gpu_check."))
    after = PYTEST_TIMEOUT_S + BENCH_TIMEOUT_S if plan.device == "cuda" else 0  # time for 2, 3
    rows = parallelism_rows(plan, logs, start + BUDGET_S - after)
    if plan.device == "cuda":
        rows += pytest_rows(plan, logs)
        rows.append(bench_row(plan, logs))
    passed = all(row["status"] in PASSING for row in rows)
    print(f"gpu_check on {plan.machine}: W = {plan.world_size} over {plan.backend_label}")
    if plan.gpus == 1:
        print("(one GPU: NCCL refuses two ranks on one GPU, so both ranks share it over gloo)")
    print(table(rows, plan))
    raised = [f"--- {row['check']}:\n{row['traceback']}" for row in rows if "traceback" in row]
    if raised:
        (logs / "tracebacks.txt").write_text("\n".join(raised))
    verdict = "PASS" if passed else "FAIL"
    print(
        f"gpu_check: {verdict} in {time.time() - start:.0f} s; logs in {logs}"
        + (" (tracebacks.txt: what the checks raised)" if raised else "")
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
