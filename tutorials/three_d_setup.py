"""What chapters 16 and 16b share: the GPT and the text they train it on, the two layouts they
compare, and a training run through `parallelize` whose second step is measured.

The measuring is the library's (figures.three_d.measure_step: the storages, the activations at
their peak, every message with its axis); the formulas the chapters hold it against are
miniddp/parallelize_formulas.py's.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from char_corpus import Corpus, Windows, load_corpus
from common import end_chapter, say, say_prose, section
from torch.nn import functional as F

from miniddp import MixedPrecision
from miniddp.instruments.figures.three_d import StepMeasured, measure_step
from miniddp.job.env import init_distributed
from miniddp.mesh import DeviceMesh, init_device_mesh
from miniddp.models.gpt import GPT, GPTConfig
from miniddp.parallelize import AXES, ParallelGPT, parallelize
from miniddp.parallelize_formulas import MeshLayout

WORLD = 8
# Small enough for 8 ranks on 2 cores: T = 16 characters, H = 32, 4 blocks of 4 heads.
CONTEXT, WIDTH, LAYERS, HEADS = 16, 32, 4, 4
WINDOWS = 8  # windows of text a step, over all replicas; with a pipeline, one a microbatch
CHARACTERS = 20_000  # the first characters of chapter 12's text: plenty for a few steps
LEARNING_RATE = 1e-2
THREE_D = MeshLayout.of(2, 2, 2, WINDOWS, CONTEXT)
DP_ONLY = MeshLayout.of(1, 8, 1, WINDOWS, CONTEXT)
FIGURE = "docs/figures/16_three_d.png"


def start(script: str, chapter: str, steps: int) -> tuple[list, Corpus, GPTConfig, float]:
    """Refuse any world but 8 ranks, join the job (gloo: CPU tensors on a CPU mesh, GPU or
    not), and return the text's batches, the text, the GPT's shape and the time it started."""
    refuse_other_world_sizes(script, chapter)
    started = time.perf_counter()
    init_distributed(backend="gloo")
    torch.set_num_threads(1)
    return (*text_and_model(steps), started)


def mesh_of(layout: MeshLayout) -> DeviceMesh:
    return init_device_mesh("cpu", layout.shape, mesh_dim_names=AXES)


def end_with_checks(checks: dict[str, bool], started: float, verified: str) -> None:
    """Say every check, stop at a failed one, else say what was `verified`, and end."""
    section("Checks")
    for name, passed in checks.items():
        say(f"  {'ok ' if passed else 'FAILED'} {name}")
    assert all(checks.values()), [name for name, passed in checks.items() if not passed]
    dist.barrier()
    say_prose(f"Verified on {WORLD} ranks in {time.perf_counter() - started:.0f} s: {verified}")
    end_chapter()


def text_and_model(steps: int) -> tuple[list[torch.Tensor], Corpus, GPTConfig]:
    """Chapter 12's text (its first CHARACTERS) cut into windows of T + 1 characters, WINDOWS
    of them a step in a fixed shuffled order; the text; and the GPT's shape, its vocabulary
    padded to a multiple of 8 (as nanoGPT pads GPT-2's 50,257 to 50,304) so that any TP size
    splits it. Dropout 0.0: chapter 16 says why."""
    corpus = load_corpus(max_characters=CHARACTERS)
    windows = Windows(corpus.train, CONTEXT)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0)).tolist()
    batches = [windows[order[s * WINDOWS : (s + 1) * WINDOWS]] for s in range(steps)]
    padded = -(-len(corpus.vocabulary) // 8) * 8
    return batches, corpus, GPTConfig(padded, CONTEXT, WIDTH, LAYERS, HEADS, dropout=0.0)


def build_gpt(config: GPTConfig) -> GPT:
    torch.manual_seed(0)  # every rank builds the same model: parallelize keeps its part
    return GPT(config)


def one_process(c: GPTConfig, batches: list[torch.Tensor]) -> tuple[list[float], GPT]:
    """The whole GPT in this process on every step's whole batch: the reference."""
    model = build_gpt(c)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for windows in batches:
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model


@dataclass
class Run:
    """One layout trained: this rank's part, its optimizer, each step's loss (None on the ranks
    that compute none) and the second step, measured."""

    layout: MeshLayout
    parts: ParallelGPT
    optimizer: torch.optim.Optimizer
    losses: list[float | None]
    measured: StepMeasured | None = None

    @property
    def stage(self) -> int:
        return self.parts.mesh["pp"].get_local_rank()

    def batch(self, windows: torch.Tensor) -> torch.Tensor:
        """This replica's share of the step's windows."""
        return windows.tensor_split(self.layout.dp)[self.parts.mesh["dp"].get_local_rank()]

    def train_step(self, windows: torch.Tensor) -> float | None:
        loss = self.parts.train_step(self.batch(windows))
        self.optimizer.step()
        self.optimizer.zero_grad()
        return None if loss is None else loss.item()


def train(
    layout: MeshLayout,
    mesh: DeviceMesh,
    config: GPTConfig,
    batches: list[torch.Tensor],
    mixed_precision: MixedPrecision | None = None,
) -> Run:
    """parallelize over `mesh`, then AdamW over `batches`; step 1 is measured (step 0 also
    exchanges shapes and orders, and builds Adam's state)."""
    parts = parallelize(
        build_gpt(config),
        mesh,
        n_microbatches=layout.microbatches,
        mixed_precision=mixed_precision,
    )
    run = Run(layout, parts, torch.optim.AdamW(parts.parameters(), lr=LEARNING_RATE), [])
    for number, windows in enumerate(batches):
        if number != 1:
            run.losses.append(run.train_step(windows))
            continue
        run.measured = measure_step(parts, run.optimizer, run.batch(windows))
        run.optimizer.step()
        run.optimizer.zero_grad()
        loss = run.measured.loss
        run.losses.append(None if loss is None else loss.item())
    return run


def global_losses(run: Run) -> list[float]:
    """Each step's loss over the whole batch: the mean over the ranks that computed one (the
    last stage's; a TP pair reports the same number, each replica its own windows')."""
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, run.losses)
    reporting = [losses for losses in everyone if losses[0] is not None]
    return [statistics.fmean(losses[s] for losses in reporting) for s in range(len(run.losses))]


def gather(mine: object) -> list:
    """Every rank's `mine`, in rank order, on every rank (a collective)."""
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, mine)
    return everyone


def refuse_other_world_sizes(
    script: str, chapter: str, layout: str = "(pp, dp, tp) = (2, 2, 2)"
) -> None:
    """Before any process group: the mesh needs exactly 8 ranks. Rank 0 says so, once."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == WORLD:
        return
    if os.environ.get("RANK", "0") == "0":
        raise SystemExit(
            f"Chapter {chapter} lays out 8 ranks as {layout}, and this job has "
            f"{world}: run it as torchrun --nproc_per_node=8 tutorials/{script} "
            f"(or NPROC=8 ./launch.sh tutorials/{script})"
        )
    raise SystemExit(2)
