"""The ladder: DDP built up one idea at a time, each rung a complete DDP in one file.

    1  naive.py         after backward, one blocking all-reduce per gradient
    2  overlap.py       each gradient's all-reduce launched from its hook, during backward
    3  buckets.py       gradients packed into a few flat buckets, launched in a fixed order
    4  torch_layout.py  torch's bucket layout: from here on, bitwise torch's DDP at any W
    5  ../ddp.py        MiniDDP: no_sync, unused parameters, comm hooks, and clear errors

A rung never imports another rung: read any one file alone, and
`python -m miniddp.steps diff 2 3` shows exactly what one idea adds. `LADDER` lists the rung
classes in order; each says in `claims` which of `CLAIMS` it supports, so that the same
property tests can run over every rung (and over a learner's own class).
"""

from miniddp.ddp import MiniDDP
from miniddp.steps.buckets import BucketedDDP
from miniddp.steps.naive import NaiveDDP
from miniddp.steps.overlap import OverlapDDP
from miniddp.steps.torch_layout import TorchLayoutDDP

CLAIMS = frozenset(
    {
        "batchnorm",  # buffers (BatchNorm's statistics) broadcast from rank 0 at each forward
        "mixed-dtypes",  # parameters of several dtypes in one model
        "torch-layout",  # torch's bucket layout: bitwise torch's DDP at any world size
        "no-sync",
        "find-unused-parameters",
        "comm-hook",
        "gradient-as-bucket-view",
    }
)

LADDER = [NaiveDDP, OverlapDDP, BucketedDDP, TorchLayoutDDP, MiniDDP]

__all__ = ["CLAIMS", "LADDER", "BucketedDDP", "MiniDDP", "NaiveDDP", "OverlapDDP", "TorchLayoutDDP"]
