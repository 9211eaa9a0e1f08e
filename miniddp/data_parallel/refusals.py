"""MiniDDP's refusals of a misused backward: each names the mistake and the fix.

Where torch's DDP is silent, or fails later with a message about its reducer, MiniDDP raises at
the moment the mistake happens. The texts live here so that ddp.py reads as DDP's life, and
each check there is one line: `raise gradient_twice(name)`.
"""

from __future__ import annotations

from collections.abc import Iterable

from miniddp.data_parallel.static_graph import GRAPH_CHANGED


def not_mixed_precision(value: object) -> TypeError:
    return TypeError(
        f"MiniDDP's mixed_precision must be a miniddp.MixedPrecision, such as "
        f"MixedPrecision(torch.bfloat16); got {value!r}. (fully_shard takes a "
        "MixedPrecisionPolicy; MiniDDP keeps fp32 masters and bf16 copies of its own.)"
    )


def armed_twice() -> RuntimeError:
    return RuntimeError(
        "prepare_for_backward: a synced forward already armed this wrapper's next backward (or "
        "it is reducing). Run the forwards inside no_sync() first."
    )


def gradient_after_sync(name: str) -> RuntimeError:
    return RuntimeError(
        f"Gradient of '{name}' arrived after this forward's gradients were already "
        "synchronized: backward ran twice on one synced forward, and the second result would "
        "stay unsynchronized. Run a new forward for each backward, or put the forward inside "
        "no_sync() to accumulate."
    )


def gradient_twice(name: str) -> RuntimeError:
    return RuntimeError(
        f"Parameter '{name}' got its gradient twice in one backward (reentrant backward: e.g. "
        "checkpoint(block, use_reentrant=True) with the block run twice). Use "
        "use_reentrant=False, or MiniDDP(..., static_graph=True) if every iteration uses the "
        "same parameters the same number of times."
    )


def no_gradient(names: Iterable[str]) -> RuntimeError:
    return RuntimeError(
        f"These parameters got no gradient in this backward pass: {', '.join(names)}. Their "
        "buckets were never all-reduced, so gradients are NOT synchronized. Either make every "
        "parameter take part in computing the loss, freeze the unused ones "
        "(requires_grad=False), or construct MiniDDP(..., find_unused_parameters=True)."
    )


def no_gradient_unlike_the_first(names: Iterable[str]) -> RuntimeError:
    return RuntimeError(
        f"These parameters got gradients in the first backward pass but none in this one: "
        f"{', '.join(names)}. So {GRAPH_CHANGED}"
    )


def join_with_skipped_buckets() -> RuntimeError:
    return RuntimeError(
        "MiniDDP(skip_all_reduce_unused_params=True) cannot train under Join: a rank out of "
        "batches answers every bucket's all-reduce, while the ranks still training skip the "
        "buckets their backward never reaches, so the collectives would not match (torch's DDP "
        "would hang or abort). Use Join, or skip_all_reduce_unused_params, not both."
    )
