"""`python -m miniddp.figures --out DIR`: every figure, from fresh data, in well under a minute.

    python -m miniddp.figures --out docs/figures        the committed figures
    python -m miniddp.figures --out /tmp/f --only 01,03,00   skip chapter 04's timed run

Where the data comes from:
- 01, 03: one job of 4 gloo ranks (spawned here, with a deadline) records the messages of each
  collective (`miniddp.collectives.record_messages`) and a MiniDDP's bucket layout before and
  after its rebuild. Both are the same on every run.
- 04: chapter 04 itself, under torchrun on 2 ranks over its simulated link, with `--plot`: the
  ladder's timelines and the bucket-size sweep come from a real, timed run.
- 00: one process trains the same model on one big batch and on micro-batches.
- 02, 06: drawn from the rules they picture (DistributedSampler's shards; chapter 06's
  checkpoint, crash and resume steps), no run needed.
- 11c: chapter 11c itself, under torchrun on 2 ranks with `--plot`: one step's memory on rank 0,
  every term measured, per layout and checkpointing.
- 05, 11, 13: chapter 05's no_sync timeline (2 gloo ranks), and two drawn from formulas and
  layouts: memory per rank per sharding stage, the tensor-parallel column/row split.
- 11 also runs chapter 11 under torchrun on 2 ranks with `--plot`, for its prefetch figure: one
  ZeRO-3 step without and with prefetch over the simulated link, as rank 0 recorded it (its
  memory figure, of its small model, stays behind: 11_memory.png is the formula's, at 1B).
- 14: a job of 4 gloo ranks runs GPipe and 1F1B on stages of fixed cost (figures/pipeline.py);
  14b: the four schedules' orders (GPipe, 1F1B, interleaved 1F1B, zero bubble) on the logical
  clock, no run needed.
- 16: a job of 8 gloo ranks trains chapter 16b's GPT on a (pp, dp, tp) = (2, 2, 2) mesh and
  records one step: the mesh beside every rank's F, B and traffic per axis (figures/three_d.py).
- 15: drawn from ring attention's plan (step_blocks): the blocks each of 4 ranks computes,
  causal, plain and load-balanced (figures/context_parallel.py).
- 12 (only when asked, `--only 12`: a 3-minute training run): chapter 12 under torchrun on 2
  ranks with `--plot`, its GPT's loss curves on MiniDDP and torch's DDP.
- 18 (only when asked, `--only 18`: minutes of training): chapter 18 under torchrun on 4 ranks
  with `--plot`, tokens per expert per rank, drops against the capacity factor, and the MoE
  GPT's load and loss with and without the auxiliary loss (figures/experts.py).
- 19 (only when asked, `--only 19`: minutes of training): chapter 19 under torchrun on 4 ranks
  with `--plot`, validation loss against simulated time and bytes sent (figures/local_sgd.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from miniddp.instruments.bench.options import whole_number, writable_folder
from miniddp.instruments.figures import (
    accumulation,
    context_parallel,
    data_parallel,
    draw,
    failover,
    memory_per_rank,
    pipeline,
    record,
    tensor_parallel,
    three_d,
)

REPO = Path(__file__).resolve().parents[3]  # figures, instruments, miniddp, the repository
CHAPTER_04 = REPO / "tutorials" / "04_overlap.py"
CHAPTER_04_TIMEOUT_S = 300
CHAPTER_04_FIGURES = ("04_timelines.png", "04_sweep.png")
CHAPTER_11 = REPO / "tutorials" / "11_sharding.py"
CHAPTER_11_TIMEOUT_S = 300
CHAPTER_11C = REPO / "tutorials" / "11c_memory.py"
CHAPTER_11C_TIMEOUT_S = 300
CHAPTER_12 = REPO / "tutorials" / "12_train_gpt.py"
CHAPTER_12_TIMEOUT_S = 900
CHAPTER_18 = REPO / "tutorials" / "18_experts.py"
CHAPTER_18_TIMEOUT_S = 1200
CHAPTER_19 = REPO / "tutorials" / "19_across_the_internet.py"
CHAPTER_19_TIMEOUT_S = 1800
# the default set
FIGURE_SETS = ("00", "01", "02", "03", "04", "05", "06", "11", "11c", "13", "14", "14b")
FIGURE_SETS += ("15", "16")
ON_REQUEST = ("12", "18", "19")  # whole training runs: only with --only 12, 18 or 19


def run_chapter_04(out: Path, iters: int) -> None:
    """Chapter 04 under torchrun on 2 ranks; it saves its own timelines and sweep with --plot.
    Its claims are its own test's business (tests/test_tutorials.py): here, the pictures."""
    if not CHAPTER_04.exists():
        raise FileNotFoundError(f"{CHAPTER_04} not found: run from a checkout of the repository")
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
        *(str(CHAPTER_04), "--iters", str(iters), "--plot", str(out)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in CHAPTER_04_FIGURES:
        (out / name).unlink(missing_ok=True)  # what exists afterwards is this run's
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=CHAPTER_04_TIMEOUT_S
    )
    drew = all((out / name).exists() for name in CHAPTER_04_FIGURES)
    if done.returncode != 0 and not drew:
        output = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"chapter 04 drew nothing (exit {done.returncode}):\n{output}")
    if done.returncode != 0:  # it draws before its final check: the pictures are this run's
        print(
            f"note: chapter 04 drew its figures, but its final check failed on this run "
            f"(exit {done.returncode}); run it alone to see why",
            file=sys.stderr,
        )


def run_chapter(chapter: Path, figure: Path, timeout: float, *args: str, ranks: int = 2) -> Path:
    """`chapter`'s default run under torchrun on `ranks` ranks, with --plot into `figure`'s
    folder. Like chapter 04, it checks its own claims: here, the picture."""
    figure.unlink(missing_ok=True)
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
        f"--nproc_per_node={ranks}",
        *(str(chapter), "--plot", str(figure.parent), *args),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not figure.exists():
        output = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"{chapter.name} failed (exit {done.returncode}):\n{output}")
    return figure


def run_chapter_08(out: Path) -> Path:
    """Chapter 11's prefetch timelines, drawn in a temporary folder and copied to `out`."""
    with tempfile.TemporaryDirectory() as folder:
        figure = run_chapter(CHAPTER_11, Path(folder) / "11_prefetch.png", CHAPTER_11_TIMEOUT_S)
        return Path(shutil.copy(figure, out / figure.name))


def run_chapter_12(out: Path) -> Path:
    """Chapter 12's default run, its checkpoints in a temporary folder."""
    with tempfile.TemporaryDirectory() as checkpoints:
        figure = out / "12_loss.png"
        return run_chapter(
            CHAPTER_12, figure, CHAPTER_12_TIMEOUT_S, "--checkpoint-dir", checkpoints
        )


def figure_sets(text: str) -> set[str]:
    """--only: which chapters' figures to draw."""
    chosen = set(text.split(","))
    unknown = chosen - set(FIGURE_SETS) - set(ON_REQUEST)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown figure set {', '.join(map(repr, sorted(unknown)))}; choose from "
            f"{', '.join(FIGURE_SETS + ON_REQUEST)}, comma-separated"
        )
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m miniddp.figures",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=writable_folder, required=True, help="folder for the PNGs (made if missing)"
    )
    parser.add_argument(
        "--only", type=figure_sets, default=",".join(FIGURE_SETS), help="e.g. 01,03"
    )
    parser.add_argument(
        "--iters", type=whole_number(at_least=1), default=6, help="chapter 04's timed iterations"
    )
    args = parser.parse_args(argv)
    args.out, chosen = Path(args.out), args.only
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if chosen & {"01", "03"}:
        with tempfile.TemporaryDirectory() as work_dir:
            runs, layouts = record.run_rank_job(Path(work_dir))
        if "01" in chosen:
            written.append(draw.messages(runs, record.WORLD_SIZE, args.out / "01_messages.png"))
        if "03" in chosen:
            written.append(draw.bucket_layouts(layouts, args.out / "03_buckets.png"))
    if "00" in chosen:
        title = (
            "k micro-batches with each loss / k retrace one big batch;\n"
            "without / k, SGD's step is k times longer (here it diverges)"
        )
        written.append(
            draw.accumulation(record.accumulation_losses(), args.out / "00_accumulation.png", title)
        )
    if "02" in chosen:
        written.append(data_parallel.data_parallel(args.out / "02_data_parallel.png"))
    if "06" in chosen:
        written.append(failover.failover(args.out / "06_failover.png"))
    if "05" in chosen:
        with tempfile.TemporaryDirectory() as work_dir:
            written.append(
                accumulation.draw(accumulation.record(Path(work_dir)), args.out / "05_no_sync.png")
            )
    if "11" in chosen:
        written.append(memory_per_rank.memory_per_rank(args.out / "11_memory.png"))
        written.append(run_chapter_08(args.out))
    if "11c" in chosen:
        figure = args.out / "11c_memory.png"
        written.append(run_chapter(CHAPTER_11C, figure, CHAPTER_11C_TIMEOUT_S))
    if "04" in chosen:
        run_chapter_04(args.out, args.iters)
        written += [args.out / name for name in CHAPTER_04_FIGURES]
    if "12" in chosen:
        written.append(run_chapter_12(args.out))
    if "18" in chosen:  # its experts over 4 ranks, and the MoE GPT trained twice
        figure = args.out / "18_experts.png"
        written.append(run_chapter(CHAPTER_18, figure, CHAPTER_18_TIMEOUT_S, ranks=4))
    if "19" in chosen:  # its 4 replicas, DDP and DiLoCo over the simulated link
        figure = args.out / "19_across_the_internet.png"
        written.append(run_chapter(CHAPTER_19, figure, CHAPTER_19_TIMEOUT_S, ranks=4))
    if "13" in chosen:
        written.append(tensor_parallel.column_row_split(args.out / "13_tensor_parallel.png"))
    if "14" in chosen:
        with tempfile.TemporaryDirectory() as work_dir:
            drawn = pipeline.run_pipeline_job(Path(work_dir))
        written.append(pipeline.schedules(drawn, args.out / "14_pipeline.png"))
    if "14b" in chosen:
        written.append(pipeline.schedule_lanes(args.out / "14b_schedules.png"))
    if "16" in chosen:
        with tempfile.TemporaryDirectory() as work_dir:
            steps = three_d.run_job(Path(work_dir))
        written.append(three_d.mesh_and_step(steps, args.out / "16_three_d.png"))
    if "15" in chosen:
        written.append(context_parallel.ring_blocks(args.out / "15_ring_attention.png"))
    for path in written:
        print(path)


if __name__ == "__main__":
    main()
