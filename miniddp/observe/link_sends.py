"""Point-to-point sends over the simulated link: what `simulated_link` (link.py) does for
collectives, for `dist.isend`, which pipeline stages and ring attention send by.

Inside `p2p_link(link)`, each send is issued only when the link would have carried it:

    due = when the link is next free + alpha + bytes / bandwidth    (one at a time: LinkQueue)

and the sender's Work completes when the real send has. Receives are untouched: a receive
completes when its data arrives, which is after the delayed send was issued. One thread issues
the sends in due order; dues only grow, so a FIFO keeps every pair's messages in order.

Torch's pipelining and MiniDDP's both call `dist.isend` (torch's P2POp checks its function
against `distributed_c10d.isend`, so both names are wrapped), so one link times both.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from miniddp.observe.link import Link, LinkQueue, LinkWork


class _DelayedSends:
    """One thread that issues each send when the link has carried it."""

    def __init__(self, original_isend) -> None:
        self.original = original_isend
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name="p2p-link").start()

    def _serve(self) -> None:
        while True:
            due, args, kwargs, future, delivered = self.queue.get()
            time.sleep(max(0.0, due - time.perf_counter()))
            work = self.original(*args, **kwargs)
            threading.Thread(target=_complete, args=(work, future, delivered), daemon=True).start()


def _complete(work, future: torch.futures.Future, delivered: threading.Event) -> None:
    try:
        work.wait()
        future.set_result(None)
    except Exception as error:  # the real send failed: so does the simulated one
        future.set_exception(error)
    delivered.set()


@contextmanager
def p2p_link(link: Link | None) -> Iterator[None]:
    """Inside, every `dist.isend` is delayed until the simulated link would have delivered it
    (None: the bare machine, nothing changes). Every rank should enter it, with the same link."""
    if link is None:
        yield
        return
    original = c10d.isend
    wire, sender = LinkQueue(link), _DelayedSends(original)

    def isend_over_the_link(tensor, dst=None, group=None, tag=0, group_dst=None):
        due = wire.deliver_at(time.perf_counter(), tensor.numel() * tensor.element_size())
        future: torch.futures.Future = torch.futures.Future()
        delivered = threading.Event()
        kwargs = {"dst": dst, "group": group, "tag": tag, "group_dst": group_dst}
        sender.queue.put((due, (tensor,), kwargs, future, delivered))
        return LinkWork(future, delivered)

    c10d.isend = dist.isend = isend_over_the_link
    try:
        yield
    finally:
        c10d.isend = dist.isend = original
