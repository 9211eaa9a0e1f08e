"""MiniDDP: PyTorch's DistributedDataParallel, rebuilt from scratch to be read, and from it the
rest of data and model parallelism.

The house has floors, and every import runs down (tests/test_layers.py keeps it so, and names
an import that runs up):

    floor 5  instruments/: bench/ (and the baselines it measures), figures/, the simulated
             link's process group, timeline views: they use the library like a user (bench.py
             and figures.py are the doors of `python -m miniddp.bench` and `.figures`)
    floor 4  steps/: the ladder, DDP built up one idea a rung, ending with MiniDDP; plan/: a
             layout's memory and time at any scale, from the formulas below (issue 46)
    floor 3  checkpoint/ (every parallelism's state, to disk and back), parallelize.py (the
             GPT over a (pp, dp, tp) mesh: TP, the pipeline split, then DP or FSDP; with
             parallelize_experts.py, an ep axis for its experts) and parallelize_formulas.py
             (what each of its ranks holds and sends, as formulas)
    floor 2  the parallelisms, side by side, none importing another: data_parallel/ (MiniDDP,
             its buckets, layout, comm hooks, static graph, sampler), sharding/ (ZeRO-1/2/3,
             clipping), tensor_parallel/, pipeline/, context_parallel/ (the sequence split,
             ring attention), expert_parallel/ (MoE, its all-to-all dispatch), local_sgd/
             (LocalSGD, DiLoCo: replicas that sync rarely); beside them mesh.py
             (init_device_mesh, one grid and a group per axis) and models/ (the GPT chapter
             12 trains)
    floor 1  the ground: collectives/ (from send/recv), job/ (the environment, the wait seam
             and its faults, meeting points), observe/ (the events the core tells an
             observer, timelines, the link's model, the overlap model), placement.py (the
             mark each parallelism leaves on its parameters, read by what spans them),
             same_model.py (every replica the same model: what MiniDDP, ZeRO and fully_shard
             all check)

`miniddp.faults` is job/faults.py under the name users know, as one module object (one
CollectiveFailed class, whichever name an `except` uses).
"""

import sys

import miniddp.checkpoint as checkpoint
from miniddp.data_parallel.bucket import BucketInfo
from miniddp.data_parallel.compute_copies import MixedPrecision
from miniddp.data_parallel.ddp import MiniDDP
from miniddp.data_parallel.sampler import DistributedSampler
from miniddp.job import faults
from miniddp.job.env import DistEnv, cleanup, init_distributed
from miniddp.observe.events import Event
from miniddp.sharding import ZeroRedundancyOptimizer, full_state_dict, fully_shard

# The issues' public name `miniddp.faults` (`from miniddp.faults import wait_for`) for the
# module that lives on the ground floor, miniddp/job/faults.py: one alias, one import name more.
sys.modules[f"{__name__}.faults"] = faults

__all__ = [
    "BucketInfo",
    "DistEnv",
    "DistributedSampler",
    "Event",
    "MiniDDP",
    "MixedPrecision",
    "ZeroRedundancyOptimizer",
    "checkpoint",
    "cleanup",
    "faults",
    "full_state_dict",
    "fully_shard",
    "init_distributed",
]
