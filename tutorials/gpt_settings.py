"""Chapter 12's settings: everything that shapes a run, with a command-line flag for each.

A checkpoint records them, and a run resumes only from a checkpoint written with the same:
another learning rate, batch or model would continue a different run. The flags that do not
change what is trained (how often to log, where checkpoints go, a planned crash) are not
settings.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from common import add_plot_option

from miniddp.models.gpt import GPTConfig


@dataclass(frozen=True)
class Settings:
    """Everything that shapes the run: a checkpoint resumes only a run with the same."""

    steps: int = 200
    batch: int = 16  # windows per rank per micro-step
    accum: int = 1  # micro-steps per optimizer step
    context: int = 64
    width: int = 128
    layers: int = 4
    heads: int = 4
    dropout: float = 0.1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    eval_every: int = 25
    eval_windows: int = 128
    seed: int = 0
    data: str | None = None
    max_characters: int | None = None
    compare: bool = True
    shard: str | None = None
    precision: str = "fp32"  # or "bf16": bf16 compute, fp32 masters

    def model(self, vocabulary: int) -> GPTConfig:
        return GPTConfig(
            vocabulary, self.context, self.width, self.layers, self.heads, self.dropout
        )


def parse_args() -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description="Chapter 12: train a character-level GPT.")
    defaults = Settings()
    for name, value in asdict(defaults).items():
        if isinstance(value, bool) or name in ("data", "max_characters", "shard", "precision"):
            continue
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(value),
            default=value,
            help=f"(default {value})",
        )
    parser.add_argument("--data", type=Path, help="a text file to train on (default: stdlib)")
    parser.add_argument("--max-characters", type=int, help="use only the text's first N")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train torch's DDP and check it bit for bit (default on)",
    )
    parser.add_argument(
        "--shard",
        choices=("zero1", "zero2", "zero3"),
        help="also train the sharded design and check it against MiniDDP",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: compute in bf16 with fp32 masters, beside an fp32 run (default fp32)",
    )
    parser.add_argument(
        "--one-process-steps",
        type=int,
        default=10,
        metavar="N",
        help="rank 0 trains one process on the global batch for N steps",
    )
    parser.add_argument("--log-every", type=int, default=10, metavar="N")
    parser.add_argument("--checkpoint-every", type=int, default=25, metavar="N")
    parser.add_argument("--checkpoint-dir", type=Path, help="(default: ./checkpoints/12_...)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint-dir (automatic after a torchrun restart)",
    )
    parser.add_argument(
        "--crash-at-step",
        type=int,
        metavar="K",
        help="the last rank exits abruptly after step K, on the first attempt",
    )
    add_plot_option(parser)
    args = parser.parse_args()
    chosen = {name: getattr(args, name) for name in asdict(defaults)}
    chosen["data"] = str(args.data) if args.data else None
    settings = Settings(**chosen)
    if settings.steps < 1 or settings.accum < 1 or settings.eval_every < 1 or args.log_every < 1:
        parser.error("--steps, --accum, --eval-every and --log-every must be at least 1")
    return settings, args
