"""A simulated network link: the same slow wire under every design, on any laptop.

On one machine, "communication" is memory copies by the cores that run backward: fast, and it
steals compute, so overlap is noise. `simulated_link` gives the machine a slow link beside
compute instead. Each torch.distributed collective still runs for real (so the sums are right),
but its completion is held back until the link would have delivered it:

    seconds = alpha + wire_bytes / bandwidth

alpha is the collective's latency (wake-ups, handshakes, the first byte's trip), paid once per
collective; wire_bytes is what the best ring algorithm makes each rank send, and receive, at once:

    all_reduce       2(W-1)/W n    reduce-scatter then all-gather (chapter 01)
    broadcast        n             a pipelined chain: every rank receives it once, passes it on
    all_gather       (W-1) n       every other rank's n bytes (n: one rank's input)
    reduce_scatter   (W-1) n       every other rank's share of this rank's n-byte output
    all_to_all       (W-1)/W n     every other rank's share of this rank's n-byte input
    reduce           n             broadcast's chain, run backwards
    scatter, gather  (W-1)/W n     the root's n bytes, all but its own share (the root's link
                                   is the busiest: the others wait for it)

Each direction of the link carries one transfer at a time: a collective issued while another is
on the wire queues behind it (`LinkQueue`). Collectives send and receive the same bytes at once,
so both directions are busy together and one queue describes both. One rank: no wire.

It completes at the later of its real completion and the link's, by sleeping: one thread keeps
the deliveries in a heap and sleeps until the earliest is due. That simulation is an instrument,
apart from the library: the process group that applies this model to every operation, with its
queues (`LinkQueue`) and its delivering thread, is miniddp/instruments/link_group.py. What stays
here is the model, which the formulas use too (miniddp/parallelize_formulas.py prices a layout
with it):

    with simulated_link(Link.parse("alpha=200us,bandwidth=1gbit")):   # or $MINIDDP_LINK
        model = MiniDDP(net)            # its broadcast and all-reduces cross the link
        torch_ddp = DistributedDataParallel(net)   # and so do torch's DDP's buckets

A cluster has two speeds: a fast link among a node's GPUs, a slow one between nodes.
`TwoSpeed(inside, across, ranks_per_node)` gives each its own queue: a collective whose group
lies in one node crosses `inside`; one whose group spans nodes, `across`, the slowest hop of
its ring, which sets its pace (chapter 11b times HSDP, ZeRO-3 and DDP on one).
"""

import argparse
import math
import re
from dataclasses import dataclass
from fractions import Fraction

import torch.distributed as dist

ENVIRONMENT_VARIABLE = "MINIDDP_LINK"
EXAMPLE = "alpha=200us,bandwidth=1gbit"
_BITS = ("bit", "kbit", "mbit", "gbit", "tbit")
# Exact fractions ("200us" is the float 200e-6, not 200 * 1e-6). Rates as tc spells them, in
# bits per second with decimal prefixes; stored as bytes per second.
_TIME_UNITS = {unit: Fraction(1, 1000**power) for power, unit in enumerate(("s", "ms", "us", "ns"))}
_RATE_UNITS = {unit: Fraction(1000**power, 8) for power, unit in enumerate(_BITS)}
_LARGEST = Fraction(1e300)  # past any real link, and still a float
# field -> (what it is, its units, whether it must be > 0 rather than >= 0, a valid value)
_FIELDS = {
    "alpha": ("a time", _TIME_UNITS, False, "alpha=200us"),
    "bandwidth": ("a rate", _RATE_UNITS, True, "bandwidth=1gbit"),
}


class BadLink(ValueError, argparse.ArgumentTypeError):
    """A link that cannot be read; as an ArgumentTypeError, argparse shows its message."""

    def __init__(self, text: str, problem: str) -> None:
        examples = f"{EXAMPLE!r}, 'alpha=1ms,bandwidth=100mbit', or 'none' for the bare machine"
        super().__init__(f"cannot read the link {text!r}: {problem}. Examples: {examples}.")


@dataclass(frozen=True)
class Link:
    """Latency `alpha` (seconds per collective) and `bandwidth` (bytes per second, each way)."""

    alpha: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise BadLink(str(self), f"alpha must be a finite time >= 0, got {self.alpha}")
        if not (self.bandwidth > 0):
            raise BadLink(str(self), f"bandwidth must be > 0, got {self.bandwidth}")

    def seconds(self, wire_bytes: float) -> float:
        """How long one transfer of `wire_bytes` occupies the link."""
        return self.alpha + wire_bytes / self.bandwidth

    @staticmethod
    def parse(text: str | None) -> "Link | None":
        """ "alpha=200us,bandwidth=1gbit" -> Link; "none", "" or None -> None (the bare machine)."""
        if text is None or text.strip().lower() in ("", "none"):
            return None
        fields: dict[str, str] = {}
        for part in text.lower().split(","):
            name, sep, value = (piece.strip() for piece in part.partition("="))
            if not sep:
                raise BadLink(text, f"{part.strip()!r} is not name=value")
            if name not in _FIELDS:
                raise BadLink(text, f"{name!r} is not a field of a link: give alpha and bandwidth")
            if name in fields:
                raise BadLink(text, f"{name} is given twice")
            fields[name] = value
        missing = [name for name in _FIELDS if name not in fields]
        if missing:
            are = "is" if len(missing) == 1 else "are"
            raise BadLink(text, f"{' and '.join(missing)} {are} missing: give alpha and bandwidth")
        return Link(**{name: _quantity(name, fields[name], text) for name in _FIELDS})

    def __str__(self) -> str:
        bits = self.bandwidth * 8
        power = max(p for p in range(len(_BITS)) if p == 0 or bits >= 1000**p)
        unit = next((u for u, size in _TIME_UNITS.items() if self.alpha >= size), "ns")
        alpha = self.alpha / float(_TIME_UNITS[unit])  # in the largest unit it fills: 1ms
        return f"alpha={alpha:g}{unit},bandwidth={bits / 1000**power:g}{_BITS[power]}"


@dataclass(frozen=True)
class TwoSpeed:
    """`inside` among the ranks of one node, `across` between nodes; a node is a run of
    `ranks_per_node` consecutive ranks, as torchrun numbers them."""

    inside: Link
    across: Link
    ranks_per_node: int

    def link_of(self, group: dist.ProcessGroup | None) -> Link:
        """The link a collective over `group` crosses: `across` if it holds two nodes' ranks."""
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        return self.across if len({r // self.ranks_per_node for r in ranks}) > 1 else self.inside

    def __str__(self) -> str:
        return f"{self.inside} inside a node of {self.ranks_per_node}, {self.across} across"


def _quantity(field: str, value: str, text: str) -> float:
    """One field's value: a number and a unit, such as 200us or 1gbit, checked against its bound."""
    kind, units, positive, example = _FIELDS[field]
    match = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)", value)
    number = Fraction(match.group(1)) if match else None
    if number is None:
        problem = "is not a number"
    elif number < 0 or (positive and number == 0):
        problem = "is negative" if number < 0 else "is zero"
    elif not match.group(2):
        problem = "has no unit"
    elif match.group(2) not in units:
        problem = f"has an unknown unit, {match.group(2)!r}"
    elif number * units[match.group(2)] > _LARGEST:
        problem = "is too large"
    else:
        return float(number * units[match.group(2)])
    wanted = f"{kind} {'> 0' if positive else '>= 0'} with a unit ({', '.join(units)})"
    raise BadLink(text, f"{field}={value} {problem}; {field} must be {wanted}, e.g. {example}")


def wire_bytes(collective: str, nbytes: int, world_size: int) -> float:
    """Bytes each rank sends (and receives) in `collective` of an n-byte tensor (see the table
    above; n is the input for all_gather, the output for reduce_scatter)."""
    w = world_size
    per_collective = {
        "all_reduce": 2 * (w - 1) / w * nbytes,
        "broadcast": nbytes if w > 1 else 0,
        "all_gather": (w - 1) * nbytes,
        "reduce_scatter": (w - 1) * nbytes,
        "all_to_all": (w - 1) / w * nbytes,
        "reduce": nbytes if w > 1 else 0,
        "scatter": (w - 1) / w * nbytes,
        "gather": (w - 1) / w * nbytes,
    }
    if collective not in per_collective:
        raise ValueError(f"no wire model for {collective!r}; known: {', '.join(per_collective)}")
    return per_collective[collective]
