"""Every tutorial chapter runs to the end on 2 ranks, and launch.sh works.

Chapters check their own claims with asserts, so exit code 0 means the chapter's story held.
Most run as torchrun's workers would, without its agent (tests/harness/processes.py says why);
the README's chapter runs through `./launch.sh`, and the chapter about nodes under torchrun
(chapter 06, restarts, has its own tests: tests/test_failover.py).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from miniddp.instruments.timeline_views import (
    LINE,  # tutorials/common.py's say() wraps longer lines
)
from tests.harness.processes import (
    child_env,
    run_in_own_session,
    run_ranks_like_torchrun,
    tail,
)

REPO = Path(__file__).resolve().parents[1]
TORCH_LOG = re.compile(r"[DIWEF]\d{4} \d\d:\d\d:\d\d")
# Globbed at collection time, so a new chapter is tested without touching this file; a chapter
# is a number, perhaps a letter (02b_overlap.py: chapter 02 comes in parts), then a name.
# Chapter 12's default run is a minutes-long training: tests/test_train_gpt.py runs the same
# code on a tiny GPT, with its checks, instead.
# Chapters 02 and 03 (the README's) run through `./launch.sh` below. Chapter 06 has its own
# tests/test_failover.py: uninterrupted, crashed and restarted by torchrun, and once finished.
# Chapters 16, 16b and 16c need 8 ranks, 11b, 16d and 19 4 (in 19 one dies): their own tests
# are at the end of this file.
OWN_TESTS = {
    "02_naive_ddp.py",
    "03_bucketing.py",
    "06_failover.py",
    "11b_hsdp.py",
    "16d_large_model_template.py",
    "12_train_gpt.py",
    "16_three_d_parallel.py",
    "19_across_the_internet.py",
    "16c_four_d.py",
    "16b_three_d_traffic.py",
}
CHAPTERS = [
    chapter
    for chapter in sorted((REPO / "tutorials").glob("[0-9][0-9]*_*.py"))
    if chapter.name not in OWN_TESTS
]
TIMEOUT_SECONDS = 240
# Chapter 07 reads the node's variables, which only torchrun's agent sets.
UNDER_TORCHRUN = {"07_multinode.py"}
# A chapter is one sitting (#44): at most this many lines printed by its default run, beyond
# torch's own log lines. Those listed are being reshaped by their owners, each named.
PRINTED_LINES = 150
PRINTS_MORE_FOR_NOW: dict[str, str] = {}
# Inherited values would change what launch.sh runs.
LAUNCH_VARIABLES = ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MAX_RESTARTS")


def printed(output: str) -> list[str]:
    """The chapter's own lines: not torch's log lines, which start with their level and date
    ("W1202 00:14:04")."""
    return [line for line in output.splitlines() if not TORCH_LOG.match(line)]


def too_wide(output: str, tmp_path: Path) -> list[str]:
    """The chapter's lines that need a terminal wider than LINE, but for a line that names the
    test's own temporary folder (a path the chapter was given, say its checkpoints')."""
    return [line for line in printed(output) if len(line) > LINE and str(tmp_path) not in line]


def run(command: list[str], tmp_path: Path) -> tuple[int, str]:
    """Run `command` from the repo root; return its exit code and combined output."""
    return run_in_own_session(command, child_env(tmp_path, drop=LAUNCH_VARIABLES), TIMEOUT_SECONDS)


def run_chapter(chapter: Path, nproc: int, tmp_path: Path, *args: str) -> tuple[int, str]:
    if chapter.name in UNDER_TORCHRUN:
        return run(torchrun(chapter, nproc) + list(args), tmp_path)
    env = child_env(tmp_path, drop=LAUNCH_VARIABLES)
    command = [sys.executable, str(chapter), *args]
    return run_ranks_like_torchrun(command, nproc, env, TIMEOUT_SECONDS)


def torchrun(chapter: Path, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(chapter),
    ]


# Run with `pytest -m slow`, each a long run whose checks the default suite makes elsewhere:
# 04's claims are timings over the simulated link (its gradients against torch's DDP:
# tests/test_link.py); 07's ranks on emulated nodes (tests/test_multinode.py); 14's, 14b's and
# 14c's orders on the logical clock and their bits (tests/test_pipeline*.py); 18's layer against
# one process and its all-to-all (tests/test_expert_parallel.py, tests/test_all_to_all.py), and
# its GPT through parallelize (tests/test_parallelize_ep.py): it trains for 2 x 200 steps.
SLOW_CHAPTERS = {
    "04_overlap.py",
    "07_multinode.py",
    "14_pipeline_parallel.py",
    "14b_interleaved_zero_bubble.py",
    "14c_v_schedules.py",
    "18_experts.py",
}


@pytest.mark.parametrize(
    "chapter",
    [pytest.param(c, marks=pytest.mark.slow) if c.name in SLOW_CHAPTERS else c for c in CHAPTERS],
    ids=[chapter.name for chapter in CHAPTERS],
)
def test_chapter_runs_on_two_ranks(chapter: Path, tmp_path: Path) -> None:
    args = []
    if chapter.name == "04_overlap.py":  # it draws its own figures (python -m miniddp.figures)
        # At its default 8 timed iterations: on 4, a clean-clone CI run once measured an
        # overlap 0.16 away from the model's (the chapter allows 0.1).
        args = ["--plot", str(tmp_path / "figures")]
    returncode, output = run_chapter(chapter, 2, tmp_path, *args)
    assert returncode == 0, f"{chapter.name} exited with {returncode}:\n{tail(output)}"
    wide = too_wide(output, tmp_path)
    assert not wide, f"{chapter.name} printed lines over {LINE} characters:\n" + "\n".join(wide)
    lines = len(printed(output))
    if chapter.name not in PRINTS_MORE_FOR_NOW:
        assert lines <= PRINTED_LINES, f"{chapter.name} printed {lines} lines: more than a sitting"
    else:  # the list cannot outlive its reason
        assert lines > PRINTED_LINES, f"{chapter.name} fits now: take it off PRINTS_MORE_FOR_NOW"
    if chapter.name == "04_overlap.py":
        for name in ("04_timelines.png", "04_sweep.png"):
            assert (tmp_path / "figures" / name).stat().st_size > 10_000, name


def test_launch_sh_runs_the_readmes_chapter_and_prints_no_warning(tmp_path: Path) -> None:
    """A fresh install says only what the chapter says: no "Failed to initialize NumPy", no
    deprecation notice, from torchrun, torch or MiniDDP."""
    returncode, output = run(["./launch.sh"], tmp_path)
    assert returncode == 0, f"launch.sh exited with {returncode}:\n{tail(output)}"
    default = REPO / "tutorials" / "03_bucketing.py"  # launch.sh names its default in full
    assert f"torchrun --standalone --nproc_per_node=2 {default}" in output
    warnings = [line for line in output.splitlines() if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)


# -m slow: an odd world's collectives are tests/test_collectives.py's at W = 3; 4 oversubscribes
@pytest.mark.parametrize("nproc", [pytest.param(n, marks=pytest.mark.slow) for n in (3, 4)])
def test_collectives_chapter_runs_on_three_and_four_ranks(nproc: int, tmp_path: Path) -> None:
    """Chapter 01 is written for 4 ranks: trees two levels deep, a ring of four chunks. On 3 (the
    FAQ's odd number of ranks) a tree step has an idle sender and recursive doubling an extra
    rank."""
    chapter = REPO / "tutorials" / "01_collectives.py"
    returncode, output = run_chapter(chapter, nproc, tmp_path)
    assert_one_sitting(chapter, returncode, output, tmp_path)
    assert f"Verified on {nproc} ranks" in output


# Written for 4 ranks, and run on 2 above (faster, and they say 2 work too): on 4 they print
# another rank's lines and longer schedules, and must still fit a sitting.
WRITTEN_FOR_FOUR = (
    "14_pipeline_parallel.py",
    "14b_interleaved_zero_bubble.py",
    "14c_v_schedules.py",
)


@pytest.mark.slow  # 4 ranks on 2 cores, up to a minute each
@pytest.mark.parametrize("name", [*WRITTEN_FOR_FOUR, "18_experts.py"])
def test_a_chapter_written_for_four_ranks_fits_a_sitting_on_four(name: str, tmp_path: Path) -> None:
    chapter = REPO / "tutorials" / name
    returncode, output = run_chapter(chapter, 4, tmp_path)
    assert_one_sitting(chapter, returncode, output, tmp_path)


def test_launch_sh_runs_chapter_02(tmp_path: Path) -> None:
    """Chapter 02's run, and launch.sh given a script by a relative path."""
    returncode, output = run(["./launch.sh", "tutorials/02_naive_ddp.py"], tmp_path)
    assert returncode == 0, f"launch.sh exited with {returncode}:\n{tail(output)}"
    assert "torchrun --standalone --nproc_per_node=2 tutorials/02_naive_ddp.py" in output


def test_launch_sh_help_prints_usage(tmp_path: Path) -> None:
    returncode, output = run(["./launch.sh", "--help"], tmp_path)
    assert returncode == 0
    assert output.startswith("Usage: ./launch.sh")
    assert "NPROC" in output and "MASTER_PORT" in output


THREE_D = REPO / "tutorials" / "16_three_d_parallel.py"
THREE_D_TRAFFIC = REPO / "tutorials" / "16b_three_d_traffic.py"


def assert_one_sitting(chapter: Path, returncode: int, output: str, tmp_path: Path) -> None:
    """A chapter that needs more than 2 ranks, at its own count: it ended in its check, and
    what it printed fits a sitting (#44), as test_chapter_runs_on_two_ranks asks of the rest."""
    assert returncode == 0, f"{chapter.name} exited with {returncode}:\n{tail(output)}"
    assert "FAILED" not in output
    wide = too_wide(output, tmp_path)
    assert not wide, f"{chapter.name} printed lines over {LINE} characters:\n" + "\n".join(wide)
    lines = len(printed(output))
    assert lines <= PRINTED_LINES, f"{chapter.name} printed {lines} lines: more than a sitting"


def assert_verified_on_eight(chapter: Path, returncode: int, output: str, tmp_path: Path) -> None:
    assert_one_sitting(chapter, returncode, output, tmp_path)
    assert "Verified on 8 ranks" in output


@pytest.mark.slow  # 40 s; the default suite trains the same composition (test_parallelize.py)
def test_the_three_d_chapter_runs_quickly_on_eight_ranks(tmp_path: Path) -> None:
    """Chapter 16 on its 8 ranks, 2 steps: every check. About 30 s here, most of it 8 processes
    importing torch. tests/test_three_d_audit.py checks its formulas by default."""
    returncode, output = run_chapter(THREE_D, 8, tmp_path, "--steps", "2")
    assert_verified_on_eight(THREE_D, returncode, output, tmp_path)


@pytest.mark.slow  # 40 s; the default suite trains bf16 compositions: test_parallelize_mixed_...
def test_the_three_d_chapter_trains_in_bf16_beside_fp32(tmp_path: Path) -> None:
    """--precision bf16: section 4 trains the 3-D layout again in bf16 on fp32 masters, and
    checks its loss against fp32's, its bytes against the formula, and the masters' dtype."""
    returncode, output = run_chapter(THREE_D, 8, tmp_path, "--precision", "bf16", "--steps", "2")
    assert "4. The same 3-D run in bf16, on fp32 masters" in output, tail(output)
    for check in ("bf16 loss within", "bf16 memory per rank", "bf16: parameters fp32"):
        assert re.search(rf"ok  {re.escape(check)}", output), f"{check}:\n{tail(output)}"
    assert_verified_on_eight(THREE_D, returncode, output, tmp_path)


@pytest.mark.slow  # 30 s; tests/test_three_d_audit.py counts the same messages by default
def test_the_traffic_chapter_runs_quickly_on_eight_ranks(tmp_path: Path) -> None:
    """Chapter 16b, nothing timed: its messages against the formula, the layouts priced, one
    step recorded on every rank."""
    returncode, output = run_chapter(THREE_D_TRAFFIC, 8, tmp_path, "--link", "none")
    assert "nothing timed" in output, tail(output)
    assert_verified_on_eight(THREE_D_TRAFFIC, returncode, output, tmp_path)


@pytest.mark.slow  # 1-2 minutes: two layouts timed over the simulated link
def test_the_traffic_chapter_default_run_times_two_layouts_and_draws_its_step(
    tmp_path: Path,
) -> None:
    figures = tmp_path / "figures"
    returncode, output = run_chapter(THREE_D_TRAFFIC, 8, tmp_path, "--plot", str(figures))
    assert_verified_on_eight(THREE_D_TRAFFIC, returncode, output, tmp_path)
    assert "x; measured: " in output or "the model calls it close" in output  # it timed
    assert (figures / "16_three_d.png").stat().st_size > 10_000


@pytest.mark.parametrize("chapter", [THREE_D, THREE_D_TRAFFIC], ids=lambda c: c.name)
def test_the_three_d_chapters_refuse_another_world_size(chapter: Path, tmp_path: Path) -> None:
    """Started as one process (or on any number of ranks but 8), each says how to start it,
    once, before building anything."""
    env = child_env(tmp_path, drop=(*LAUNCH_VARIABLES, "WORLD_SIZE", "RANK", "LOCAL_RANK"))
    command = [sys.executable, str(chapter), "--steps", "2"]
    returncode, output = run_in_own_session(command, env, TIMEOUT_SECONDS)
    assert returncode == 1, tail(output)
    assert output.count(f"torchrun --nproc_per_node=8 tutorials/{chapter.name}") == 1
    assert "this job has 1" in output and "Traceback" not in output


HSDP_CHAPTER = REPO / "tutorials" / "11b_hsdp.py"


@pytest.mark.slow  # 4 ranks on 2 cores, timed over the simulated link; the default suite checks
def test_the_hsdp_chapter_runs_on_four_ranks(tmp_path: Path) -> None:  # test_sharding_hsdp.py
    returncode, output = run_chapter(HSDP_CHAPTER, 4, tmp_path)
    assert_one_sitting(HSDP_CHAPTER, returncode, output, tmp_path)
    assert "Verified on 4 ranks" in output


def test_the_hsdp_chapter_refuses_another_world_size(tmp_path: Path) -> None:
    env = child_env(tmp_path, drop=(*LAUNCH_VARIABLES, "WORLD_SIZE", "RANK", "LOCAL_RANK"))
    returncode, output = run_in_own_session([sys.executable, str(HSDP_CHAPTER)], env, 60)
    assert returncode == 1, tail(output)
    assert output.count("torchrun --nproc_per_node=4 tutorials/11b_hsdp.py") == 1
    assert "Traceback" not in output


LARGE_MODEL = REPO / "tutorials" / "16d_large_model_template.py"


@pytest.mark.slow  # 95 s here; the default suite trains its functions: test_large_model_template
def test_the_large_model_template_runs_on_four_ranks(tmp_path: Path) -> None:
    """Its default run, (dp, tp) = (2, 2): DCP save, a lost checkpoint, a resume, one process."""
    args = ("--checkpoints", str(tmp_path / "dcp"))
    returncode, output = run_chapter(LARGE_MODEL, 4, tmp_path, *args)
    assert_one_sitting(LARGE_MODEL, returncode, output, tmp_path)
    assert "Verified on 4 ranks" in output


@pytest.mark.slow  # 30 s each here
@pytest.mark.parametrize("tp", ["1", "2"])
def test_the_large_model_template_runs_on_two_ranks(tp: str, tmp_path: Path) -> None:
    """(dp, tp) = (2, 1), fully_shard alone, and (1, 2), TP alone."""
    args = ("--tp", tp, "--steps", "4", "--checkpoints", str(tmp_path / "dcp"))
    returncode, output = run_chapter(LARGE_MODEL, 2, tmp_path, *args)
    assert returncode == 0, f"{LARGE_MODEL.name} exited with {returncode}:\n{tail(output)}"
    assert "Verified on 2 ranks" in output


def test_the_large_model_template_refuses_a_mesh_that_does_not_fit(tmp_path: Path) -> None:
    """Started as one process, it says how to start it, once, before any process group."""
    env = child_env(tmp_path, drop=(*LAUNCH_VARIABLES, "WORLD_SIZE", "RANK", "LOCAL_RANK"))
    returncode, output = run_in_own_session([sys.executable, str(LARGE_MODEL)], env, 60)
    assert returncode == 1, tail(output)
    assert output.count("torchrun --nproc_per_node=4 tutorials/16d_large_model_template.py") == 1
    assert "Traceback" not in output


ACROSS = REPO / "tutorials" / "19_across_the_internet.py"


@pytest.mark.slow  # a minute or two: 4 ranks train six ways; tests/test_local_sgd.py checks them
def test_the_across_the_internet_chapter_runs_short_on_four_ranks(tmp_path: Path) -> None:
    """Chapter 19 on its 4 replicas, 40 steps a run: its checks, and replica 3's death."""
    returncode, output = run_chapter(ACROSS, 4, tmp_path, "--steps", "40")
    assert_one_sitting(ACROSS, returncode, output, tmp_path)
    assert "Chapter 19 done: every check held." in output, tail(output)


FOUR_D = REPO / "tutorials" / "16c_four_d.py"


@pytest.mark.slow  # 8 ranks on 2 cores; the default suite checks the same compositions in
def test_the_four_d_chapter_runs_on_eight_ranks(tmp_path: Path) -> None:  # test_parallelize_cp
    returncode, output = run_chapter(FOUR_D, 8, tmp_path)
    assert_verified_on_eight(FOUR_D, returncode, output, tmp_path)


def test_the_four_d_chapter_refuses_another_world_size(tmp_path: Path) -> None:
    env = child_env(tmp_path, drop=(*LAUNCH_VARIABLES, "WORLD_SIZE", "RANK", "LOCAL_RANK"))
    returncode, output = run_in_own_session([sys.executable, str(FOUR_D)], env, 60)
    assert returncode == 1, tail(output)
    assert output.count("torchrun --nproc_per_node=8 tutorials/16c_four_d.py") == 1
    assert "Traceback" not in output
