"""Every collective DDP relies on, built from nothing but point-to-point sends and receives.

Same names, arguments and in-place behaviour as torch.distributed, so the two read side by side;
chapter 01 (tutorials/01_collectives.py) runs them step by step. One idea a file, in reading
order:

    peers.py        how the algorithms talk: sends and receives, counted and logged
    naive.py        broadcast and reduce the obvious way: the root talks to everyone in turn
    tree.py         the binomial tree: broadcast, reduce, and all-reduce in ceil(log2 W) steps
    doubling.py     recursive doubling: the all-reduce with the fewest steps
    ring.py         the ring: reduce-scatter, all-gather, the bandwidth-optimal all-reduce
    all_to_all.py   the pairwise exchange: a different piece from every rank to every rank
    comm_thread.py  async collectives: one thread runs them all, in the order they were issued
    api.py          the functions a user calls, their argument checks and algorithm choice
    cost_model.py   every algorithm's steps and bytes side by side, the alpha-beta model
                    fitted on this machine, and which all-reduce `auto` picks by size
"""

from miniddp.collectives.api import (
    ALL_REDUCE_ALGORITHMS,
    BROADCAST_ALGORITHMS,
    REDUCE_ALGORITHMS,
    Labelled,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    all_to_all_single_autograd,
    broadcast,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
)
from miniddp.collectives.comm_thread import STOP_TIMEOUT_SECONDS, Work
from miniddp.collectives.cost_model import (
    AUTO_CHOICES,
    CostModel,
    KiB,
    MiB,
    all_to_all_time,
    choose_all_reduce_algorithm,
    fit_cost_model,
    schedule,
)
from miniddp.collectives.peers import MESSAGE_TAG, Message, Traffic, record_messages, traffic

__all__ = [
    "ALL_REDUCE_ALGORITHMS",
    "AUTO_CHOICES",
    "BROADCAST_ALGORITHMS",
    "MESSAGE_TAG",
    "REDUCE_ALGORITHMS",
    "STOP_TIMEOUT_SECONDS",
    "CostModel",
    "KiB",
    "Labelled",
    "Message",
    "MiB",
    "Traffic",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "all_to_all_time",
    "broadcast",
    "choose_all_reduce_algorithm",
    "fit_cost_model",
    "record_messages",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "schedule",
    "traffic",
]
