"""Chapter 12's text: real characters, no download, the same bytes on every machine.

The default corpus is Python itself: the source of fourteen standard-library modules of the
interpreter running the chapter, read in sorted order. Every machine with the same Python
version holds the same files, so every run trains on the same bytes (the chapter prints their
SHA-256 to compare); another version gives other, equally good text. `--data FILE` trains on
any text file instead, e.g. the 1.1 MB of Shakespeare that char-rnn and nanoGPT use:

    curl -O https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt

The split is fixed and by position: the first 90% of the characters train, the last 10% are
held out for validation. With the default modules that holds out most of typing.py, a module
the model never reads in training. Characters are the tokens: the vocabulary is every
character that occurs in the whole text, sorted, so both parts use one encoding. Windows cuts a
part into training examples; Batches deals them to the ranks, step by step.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from miniddp import DistributedSampler
from miniddp.checkpoint import Progress

# Pure-Python modules, as distributions ship them unpatched; about 1.1 MB on Python 3.11.
STDLIB_MODULES = (
    "argparse",
    "ast",
    "dataclasses",
    "datetime",
    "difflib",
    "enum",
    "functools",
    "inspect",
    "pathlib",
    "pickle",
    "statistics",
    "subprocess",
    "threading",
    "typing",
)
TRAIN_FRACTION = 0.9


@dataclass(frozen=True)
class Corpus:
    """A text, its character vocabulary, and the encoded train and validation parts."""

    source: str  # where the text came from, for the reader
    text: str
    vocabulary: str  # character i of it is token i
    train: torch.Tensor  # int64 token ids, the first TRAIN_FRACTION of the text
    validation: torch.Tensor  # the rest

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.vocabulary[i] for i in tokens.tolist())


def stdlib_text() -> tuple[str, str]:
    """The default text: STDLIB_MODULES of this interpreter, each as a comment naming it, then
    its source. Returns (where from, text)."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    parts = [
        f"# {name}.py\n{(folder / f'{name}.py').read_text()}" for name in sorted(STDLIB_MODULES)
    ]
    return f"{len(parts)} modules of the standard library in {folder}", "".join(parts)


def load_corpus(data: Path | None = None, max_characters: int | None = None) -> Corpus:
    """`data`'s text (default: stdlib_text()), cut to its first `max_characters` if given."""
    if data is None:
        source, text = stdlib_text()
    else:
        if not data.is_file():
            raise FileNotFoundError(f"--data {data}: no such file; pass a text file")
        source, text = str(data), data.read_text(errors="replace")
    text = text[:max_characters]
    if len(text) < 1000:
        raise ValueError(
            f"{source} has {len(text)} characters: too little to split into training and "
            "validation windows. Pass a longer text (or a larger --max-characters)."
        )
    vocabulary = "".join(sorted(set(text)))
    index = {character: i for i, character in enumerate(vocabulary)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
    cut = int(TRAIN_FRACTION * len(tokens))
    return Corpus(source, text, vocabulary, tokens[:cut], tokens[cut:])


class Windows:
    """The text cut into consecutive, non-overlapping windows of `length + 1` tokens, sharing
    one token at each seam: window i is tokens [i·length, (i+1)·length], its first `length`
    the input and its last `length` the targets. `windows[indices]` stacks them (B, length + 1),
    as a sampler's indices ask."""

    def __init__(self, tokens: torch.Tensor, length: int) -> None:
        count = (len(tokens) - 1) // length
        if count < 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of {length + 1}")
        self.rows = tokens[: count * length + 1].unfold(0, length + 1, length)  # a view

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        return self.rows[indices]


class Batches:
    """Which windows each rank trains on at each step. Rank r's own DistributedSampler (drop_last:
    every rank the same number of steps), `set_epoch` at each epoch's start, and `accum`
    micro-batches of `batch` windows per step. Everything follows from the step number, so a
    resumed run picks up mid-epoch at exactly the right window; rank 0 can also ask for every
    rank's share."""

    def __init__(self, windows: Windows, world: int, batch: int, accum: int, seed: int) -> None:
        self.windows, self.batch, self.accum = windows, batch, accum
        self.samplers = [
            DistributedSampler(
                windows, num_replicas=world, rank=r, shuffle=True, seed=seed, drop_last=True
            )
            for r in range(world)
        ]
        self.steps_per_epoch = len(self.samplers[0]) // (batch * accum)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"{len(windows)} training windows cannot fill one step of {world} ranks x "
                f"{accum} x {batch}: pass a longer text or a smaller --batch"
            )
        self.orders: dict[int, tuple[int, list[int]]] = {}  # rank -> (epoch, its indices)

    def progress(self, steps_done: int) -> Progress:
        epoch, position = divmod(steps_done, self.steps_per_epoch)
        return Progress(steps_done, epoch, position)

    def of_rank(self, rank: int, step: int) -> list[torch.Tensor]:
        epoch, position = divmod(step, self.steps_per_epoch)
        if self.orders.get(rank, (None,))[0] != epoch:
            self.samplers[rank].set_epoch(epoch)  # forget it and every epoch replays one order
            self.orders[rank] = (epoch, list(self.samplers[rank]))
        start = position * self.batch * self.accum
        mine = self.orders[rank][1][start : start + self.batch * self.accum]
        return [self.windows[mine[k : k + self.batch]] for k in range(0, len(mine), self.batch)]
