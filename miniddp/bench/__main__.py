"""`python -m miniddp.bench COMMAND [options]`: see each command's --help."""

from __future__ import annotations

import importlib
import sys

from miniddp.bench import relaunch_under_torchrun, should_relaunch

COMMANDS = {
    "collectives": "our send/recv collectives against gloo's, with the alpha-beta cost model",
    "step": "a training step: MiniDDP's variants against torch's DDP, with overlap",
    "sharding": "memory, traffic and step time of DDP and ZeRO-1/2/3, against torch's",
    "pp": "a pipeline step (GPipe, 1F1B) against torch's pipelining, bare and over a link",
}
RANKS = {"sharding": 4}  # groups of 1, 2 and 4 ranks in one run


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m miniddp.bench COMMAND [options]\n\ncommands:")
        for name, what in COMMANDS.items():
            print(f"  {name:<12} {what}")
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    if should_relaunch() and "--help" not in argv and "-h" not in argv:
        relaunch_under_torchrun(argv, RANKS.get(argv[0], 2))
    importlib.import_module(f"miniddp.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
