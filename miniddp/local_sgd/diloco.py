"""DiLoCo (Douillard et al., 2023) and Streaming DiLoCo (Douillard et al., 2025): an inner
optimizer trains each replica alone, an outer optimizer moves the replicas' shared parameters
every H inner steps.

The maths of one sync. Every replica keeps the global parameters θ_g aside (the same on all) and
trains its own copy θ_r for H inner steps (AdamW in the paper). Then

    Δ_r = θ_g − θ_r              the pseudo-gradient: where this replica went, negated
    Δ   = (1/W) Σ_r Δ_r          averaged over the replicas: the only bytes that travel
    θ_g ← OuterOpt(θ_g, Δ)       params restored to θ_g, Δ written into .grad, outer.step()

and every replica starts the next H steps from the new θ_g. With the paper's outer optimizer,
SGD with Nesterov momentum (lr 0.7, momentum 0.9), 8 replicas matched synchronous training with
500x less communication. With H = 1 and plain SGD of lr 1, θ_g − Δ is the average of the
replicas' parameters after one step each: the average of W inner steps from θ_g, which for inner
SGD is exactly synchronous data parallelism (one step on the averaged gradient).

Streaming (`fragments`): the model is cut into F fragments, and fragment i syncs alone, after
inner steps t ≡ (i+1)·H/F (mod H): F times less to send at once, the same per H steps. With
`fragment_sync_delay` τ, fragment i's average starts τ steps early, at H/F − τ, and travels while
those τ inner steps run; at H/F it is applied to the global copy saved before, and the replica's
parameters become lerp(θ_g', θ_local, α) (`fragment_update_alpha`; α = 0, torchft's default,
keeps the new global parameters alone: the τ steps' local progress on that fragment is dropped).

Bitwise torchft's `DiLoCo` (torchft 0.2.0, `init_sync=False`): same order of operations, same
average (SUM then divide by W), one all-reduce per parameter. torchft's Manager has an
`init_sync` flag: True (its default) makes every replica but replica 0 take replica 0's
parameters at the first quorum, so replicas seeded differently still start equal. MiniDDP does
what `init_sync=False` does, no copy at the start, and instead checks at construction that the
replicas hold the same parameters (two one-number all-reduces of a fingerprint), refusing on
every rank if not: replicas that started apart would silently stay apart, since each applies
the same average to its own θ_g.

A replica that dies between syncs is named at the next one (miniddp.faults.wait_for); the
others agree through the store on who is left, finish that sync among themselves and train on,
as if the dead replica had never been there from that sync on (survivors.py).

One outer optimizer serves every fragment: a fragment's sync gives only its own parameters a
.grad, so the outer step moves (and keeps momentum for) that fragment alone. (torchft wants one
outer optimizer per fragment for that; one over the whole model would also step the other
fragments with their last inner gradients.)
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from miniddp.local_sgd.checks import (
    check_replica_group,
    check_same_parameters,
    check_sync_every,
    trainable,
)
from miniddp.local_sgd.exchange import Exchange, PendingAverage


class Phase(enum.Enum):
    BUILT = "built"  # constructed; inner steps would not be counted yet
    TRAINING = "training"  # inside `with`: inner steps counted, syncs due every H/F
    CLOSED = "closed"  # left `with`: hooks removed, the optimizers are the user's again


class Fragment:
    """Parameters that sync together: they own their global copy, and at most one average in
    flight."""

    def __init__(self, index: int, params: list[torch.Tensor]) -> None:
        self.index = index
        self.params = params
        self.global_params = [p.detach().clone() for p in params]
        self.pending: PendingAverage | None = None
        self.syncs = 0

    def start(self, exchange: Exchange) -> None:
        """Send Δ = θ_g − θ_local on its way (averaged over the replicas)."""
        if self.pending is not None:
            raise RuntimeError(f"fragment {self.index} already has an average in flight")
        with torch.no_grad():
            pseudo = [g - p.detach() for g, p in zip(self.global_params, self.params)]
        self.pending = exchange.start(pseudo)

    @torch.no_grad()
    def finish(
        self, exchange: Exchange, outer: torch.optim.Optimizer, every_param: list, alpha: float
    ) -> None:
        """Wait for Δ; restore θ_g; outer step on Δ; save the new θ_g; mix in the local θ."""
        if self.pending is None:
            raise RuntimeError(f"fragment {self.index} has no average to apply")
        averages, self.pending = exchange.wait(self.pending), None
        local = [p.detach().clone() for p in self.params]
        for param, saved in zip(self.params, self.global_params):
            param.copy_(saved)
        for param in every_param:  # only this fragment's parameters take an outer step
            param.grad = None
        for param, average in zip(self.params, averages):
            param.grad = average
        with torch.enable_grad():
            outer.step()
        for saved, param in zip(self.global_params, self.params):
            saved.copy_(param)
        for param, mine in zip(self.params, local):
            param.lerp_(mine, alpha)
        outer.zero_grad()
        self.syncs += 1


class DiLoCo:
    """DiLoCo over `process_group` (None: the whole job), Streaming DiLoCo with `fragments`.

    Used as torchft's: `with DiLoCo(...): ... inner_optimizer.step() ...` — every inner step
    inside `with` is counted, and the syncs happen in the step's post-hook.
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        outer_optimizer: torch.optim.Optimizer,
        sync_every: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        fragments: Sequence[nn.Module] | None = None,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        algorithm: str = "gloo",
        exchange_dtype: torch.dtype | None = None,
    ) -> None:
        check_sync_every(sync_every)
        named = trainable(model)
        self.params = [p for _, p in named]
        check_same_parameters("outer optimizer", _params_of(outer_optimizer), self.params)
        check_same_parameters("inner optimizer", _params_of(inner_optimizer), self.params)
        pieces = _split(named, fragments)
        _check_schedule(sync_every, len(pieces), fragment_sync_delay, fragment_update_alpha)
        check_replica_group(named, process_group)
        self.exchange = Exchange(process_group, algorithm, exchange_dtype)
        _check_replicas_start_equal(self.params, process_group)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.outer_optimizer = outer_optimizer
        self.sync_every = sync_every
        self.steps_per_fragment = sync_every // len(pieces)
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = fragment_update_alpha
        self.fragments = [Fragment(i, params) for i, params in enumerate(pieces)]
        self.local_step = 0  # inner steps since the last fragment sync
        self.fragment_syncs = 0  # fragment syncs so far; the next is fragment syncs % F
        self.phase = Phase.BUILT
        self._hooks = [inner_optimizer.register_step_pre_hook(self._before_inner_step)]

    @property
    def sent_bytes(self) -> int:
        return self.exchange.sent_bytes

    def fragment_offsets(self) -> list[int]:
        """Fragment i syncs after the inner steps t with t % H equal to its offset."""
        every = self.steps_per_fragment
        return [((i + 1) * every) % self.sync_every for i in range(len(self.fragments))]

    def __enter__(self) -> DiLoCo:
        if self.phase is not Phase.BUILT:
            raise RuntimeError(f"this DiLoCo is {self.phase.value}: enter a DiLoCo once")
        self.phase = Phase.TRAINING
        self.exchange.open()
        self._hooks.append(self.inner_optimizer.register_step_post_hook(self._after_inner_step))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.exchange.close()
        self.phase = Phase.CLOSED

    def _before_inner_step(self, optimizer, args, kwargs) -> None:
        if self.phase is Phase.BUILT:
            raise RuntimeError(
                "DiLoCo counts the inner optimizer's steps only inside `with diloco:`; this "
                "step would train without ever syncing. Step inside the `with` block."
            )

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        self.local_step += 1
        fragment = self.fragments[self.fragment_syncs % len(self.fragments)]
        if self.local_step == self.steps_per_fragment - self.fragment_sync_delay:
            fragment.start(self.exchange)
        if self.local_step == self.steps_per_fragment:
            fragment.finish(
                self.exchange, self.outer_optimizer, self.params, self.fragment_update_alpha
            )
            self.fragment_syncs += 1
            self.local_step = 0

    def state_dict(self) -> dict[str, Any]:
        """What DiLoCo owns, for a checkpoint: the global parameters, both optimizers (the inner
        one's moments are this replica's own, so each replica saves its own), and where in the
        schedule the run is. With the model's state dict, all a bitwise resume needs."""
        if any(f.pending is not None for f in self.fragments):
            raise RuntimeError(
                "a fragment's average is in flight (fragment_sync_delay): save right after a "
                "fragment sync, when none is"
            )
        return {
            "global_params": [[g.clone() for g in f.global_params] for f in self.fragments],
            "syncs_each": [f.syncs for f in self.fragments],
            "inner_optimizer": self.inner_optimizer.state_dict(),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "local_step": self.local_step,
            "fragment_syncs": self.fragment_syncs,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["global_params"]
        shapes = [[tuple(g.shape) for g in f.global_params] for f in self.fragments]
        if [[tuple(g.shape) for g in piece] for piece in saved] != shapes:
            raise ValueError(
                "this DiLoCo state was saved for other fragments or another model: its global "
                "parameters do not match this run's in number or shape"
            )
        for fragment, piece, syncs in zip(self.fragments, saved, state["syncs_each"]):
            for mine, theirs in zip(fragment.global_params, piece):
                mine.copy_(theirs)
            fragment.syncs = syncs
        self.inner_optimizer.load_state_dict(state["inner_optimizer"])
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.local_step = state["local_step"]
        self.fragment_syncs = state["fragment_syncs"]


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _split(
    named: list[tuple[str, torch.Tensor]], fragments: Sequence[nn.Module] | None
) -> list[list[torch.Tensor]]:
    """The model's trainable parameters cut into fragments: each in exactly one."""
    if fragments is None:
        return [[p for _, p in named]]
    if isinstance(fragments, nn.Module) or len(fragments) == 0:
        raise ValueError("fragments must be a non-empty list of the model's submodules")
    names = {id(p): n for n, p in named}
    owner: dict[int, int] = {}
    pieces = []
    for index, fragment in enumerate(fragments):
        piece = [p for p in fragment.parameters() if p.requires_grad]
        for param in piece:
            if id(param) not in names:
                raise ValueError(
                    f"fragment {index} holds a parameter of shape {tuple(param.shape)} that is "
                    "not the model's: fragments must be submodules of the model"
                )
            if id(param) in owner:
                raise ValueError(
                    f"'{names[id(param)]}' is in fragment {owner[id(param)]} and in fragment "
                    f"{index}: fragments must not overlap (it would be synced twice)"
                )
            owner[id(param)] = index
        pieces.append(piece)
    left_out = [n for n, p in named if id(p) not in owner]
    if left_out:
        raise ValueError(
            f"no fragment holds {left_out[:3]}{' and more' if len(left_out) > 3 else ''}: "
            "fragments must cover the model, or those parameters would never sync"
        )
    return pieces


def _check_schedule(sync_every: int, count: int, delay: int, alpha: float) -> None:
    if sync_every % count:
        raise ValueError(
            f"sync_every ({sync_every}) must be a multiple of the number of fragments ({count}), "
            "so that the fragments sync at even intervals, one at a time"
        )
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"fragment_sync_delay must be a whole number >= 0; got {delay!r}")
    if delay >= sync_every // count:
        raise ValueError(
            f"fragment_sync_delay ({delay}) must be less than sync_every / fragments "
            f"({sync_every // count}): a fragment's average must arrive before the next starts"
        )
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"fragment_update_alpha must be between 0 and 1; got {alpha}")


def _check_replicas_start_equal(params: list[torch.Tensor], group) -> None:
    """Raise on every replica if they do not hold the same parameters (see the module's
    docstring, on init_sync)."""
    digest = hashlib.sha256()
    for param in params:
        digest.update(param.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    fingerprint = int.from_bytes(digest.digest()[:7], "little")
    highest = torch.tensor([fingerprint], dtype=torch.int64)
    lowest = -highest
    dist.all_reduce(highest, dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lowest, dist.ReduceOp.MAX, group=group)
    if highest.item() != -lowest.item():
        raise ValueError(
            "the replicas start from different parameters, and DiLoCo would keep them apart "
            "(each applies the same average to its own global copy). Start them equal: seed "
            "alike, or copy replica 0's parameters first (torchft's init_sync=True does that)."
        )
