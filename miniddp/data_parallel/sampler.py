"""Give each rank its own slice of the dataset, with torch's `DistributedSampler` semantics.

Every rank runs the same training loop over the same dataset; the sampler is what makes them
see different samples. Rank r takes every R-th index starting at r, so the slices are disjoint.

Two details matter:

* Padding. Every step ends in an all-reduce that all ranks must join. If one rank had one batch
  more than the others, it would wait forever in that extra collective: a deadlock. So without
  `drop_last` the index list is padded (by repeating indices from the start) to a multiple of R,
  and a few samples are seen twice per epoch. With `drop_last` the tail is cut instead.
* `set_epoch`. The shuffle is seeded with `seed + epoch`, identically on every rank, so all ranks
  agree on one permutation and their slices stay disjoint. Forget to call `set_epoch(epoch)` and
  every epoch replays the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from itertools import cycle, islice

import torch
import torch.distributed as dist
from torch.utils.data import Sampler


class DistributedSampler(Sampler[int]):
    """Yield this rank's share of `range(len(dataset))`, the same length on every rank."""

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "DistributedSampler needs num_replicas and rank: pass them explicitly, or "
                    "launch with torchrun and initialise the process group first."
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(
                f"Invalid rank {rank}: with num_replicas={num_replicas} it must be in "
                f"[0, {num_replicas - 1}]."
            )
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        size = len(dataset)
        # drop_last rounds down, else up. N // R equals torch's ceil((N - R) / R) whenever
        # R does not divide N, and equals ceil(N / R) when it does.
        self.num_samples = size // num_replicas if drop_last else math.ceil(size / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Call at the start of each epoch so that the shuffle differs from the last one."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        size = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            indices = torch.randperm(size, generator=generator).tolist()
        else:
            indices = list(range(size))
        if self.drop_last:
            indices = indices[: self.total_size]
        else:
            # Wraps around as often as needed: 2 samples on 8 ranks need 6 repeats.
            indices += list(islice(cycle(indices), self.total_size - size))
        return iter(indices[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
