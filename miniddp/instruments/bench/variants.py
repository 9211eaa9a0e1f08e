"""What the step benchmark compares: the ladder's baselines, MiniDDP at several caps (and with
its launches deferred, an ablation), and torch's DDP at the same settings. Each variant names the
torch variant its times are paired with."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from miniddp.data_parallel.ddp import MiniDDP
from miniddp.instruments.bench.baselines import BASELINES, DeferredMiniDDP


def _torch_ddp(**options) -> Callable[[nn.Module], nn.Module]:
    def wrap(module: nn.Module) -> nn.Module:
        return DistributedDataParallel(module, **options)  # its reducer crosses the link group

    return wrap


def _miniddp(cls: type[MiniDDP] = MiniDDP, **options) -> Callable[[nn.Module], nn.Module]:
    return lambda module: cls(module, **options)


# name -> (how to wrap a fresh model, the torch variant it is compared with)
VARIANTS: dict[str, tuple[Callable[[nn.Module], nn.Module], str]] = {
    **{name: (cls, "torch") for name, cls in BASELINES.items()},
    "miniddp": (_miniddp(), "torch"),
    "miniddp-1": (_miniddp(bucket_cap_mb=1), "torch-1"),
    "miniddp-5": (_miniddp(bucket_cap_mb=5), "torch-5"),
    "miniddp-25": (_miniddp(bucket_cap_mb=25), "torch-25"),
    "deferred-1": (_miniddp(DeferredMiniDDP, bucket_cap_mb=1), "torch-1"),
    "miniddp-view": (_miniddp(gradient_as_bucket_view=True), "torch-view"),
    "torch": (_torch_ddp(), "torch"),
    "torch-1": (_torch_ddp(bucket_cap_mb=1), "torch-1"),
    "torch-5": (_torch_ddp(bucket_cap_mb=5), "torch-5"),
    "torch-25": (_torch_ddp(bucket_cap_mb=25), "torch-25"),
    "torch-view": (_torch_ddp(gradient_as_bucket_view=True), "torch-view"),
}
VARIANT_HELP = {
    "none": "no communication at all: the compute floor",
    "naive": "a blocking all-reduce per gradient after backward",
    "flat": "one bucket for every gradient, all-reduced when the last one arrives",
    "async": "an async all-reduce per gradient, launched from its hook",
    "miniddp": "MiniDDP, torch's default caps (1 MiB first bucket, then 25 MiB)",
    "miniddp-N": "MiniDDP with bucket_cap_mb=N (1, 5, 25)",
    "deferred-1": "MiniDDP at 1 MiB, launches held until backward ends (ablation)",
    "miniddp-view": "MiniDDP, default caps, gradient_as_bucket_view=True",
    "torch[-N|-view]": "torch's DistributedDataParallel with the same settings",
}
