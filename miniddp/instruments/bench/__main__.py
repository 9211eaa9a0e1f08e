"""`python -m miniddp.bench COMMAND [options]`: see each command's --help."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys

from miniddp.instruments.bench import relaunch_under_torchrun, should_relaunch
from miniddp.job.env import launched_by_torchrun

COMMANDS = {
    "collectives": "our send/recv collectives against gloo's, with the alpha-beta cost model",
    "step": "a training step: MiniDDP's variants against torch's DDP, with overlap",
    "sharding": "memory, traffic and step time of DDP and ZeRO-1/2/3, against torch's",
    "soak": "a 25M-parameter model for minutes beside a CPU hog: false alarms, bits, memory",
    "tp": "a tensor-parallel step: miniddp.tensor_parallel against torch's DTensor TP",
    "pp": "a pipeline step (GPipe, 1F1B, interleaved, zero bubble) against torch's, bare, linked",
    "compose": "the 3-D step (PP x DP x TP) of MiniDDP's pieces against torch's composition",
    "cp": "ring attention's step against one process and torch's ring, time and memory",
    "plan": "miniddp.plan's predicted step against measured ones, 4 layouts on 8 ranks",
    "diloco": "DDP against DiLoCo at each H: bytes and simulated time to a fixed loss, --link",
    "ep": "an MoE layer's step with expert parallelism; its all-to-alls against the model",
}
# sharding: groups of 1, 2 and 4; compose: (2, 2, 2); plan: 4 layouts of 8; diloco: 4 replicas
RANKS = {"sharding": 4, "compose": 8, "plan": 8, "diloco": 4}


def check_options(command: str, argv: list[str]) -> None:
    """Parse and check the command's options here, before any relaunch: a bad one (or --help)
    ends this one process at once, with argparse's message, instead of every rank after its
    start-up. Launched by torchrun directly, every rank checks, and only rank 0 says why."""
    module = importlib.import_module(f"miniddp.instruments.bench.{command}")
    parse_args = getattr(module, "parse_args", None)
    if parse_args is None:
        raise NotImplementedError(
            f"miniddp.instruments.bench.{command} has no parse_args(argv): every command parses "
            f"and checks its options there, so that the launcher can refuse bad ones before "
            f"relaunching"
        )
    quiet = launched_by_torchrun() and os.environ["RANK"] != "0"
    with contextlib.ExitStack() as stack:
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
            stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
        parse_args(argv)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        usage = "usage: python -m miniddp.bench COMMAND [options]\n\ncommands:\n"
        usage += "".join(f"  {name:<12} {what}\n" for name, what in COMMANDS.items())
        if argv and not asked:
            usage += f"\npython -m miniddp.bench: unknown command {argv[0]!r}\n"
        print(usage, end="", file=sys.stdout if asked else sys.stderr)
        sys.exit(0 if asked else 2)
    command, options = argv[0], argv[1:]
    check_options(command, options)
    if should_relaunch():
        relaunch_under_torchrun(argv, RANKS.get(command, 2))
    importlib.import_module(f"miniddp.instruments.bench.{command}").main(options)


if __name__ == "__main__":
    main(sys.argv[1:])
