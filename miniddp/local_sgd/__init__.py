"""Past one datacenter: replicas that sync rarely, so that a slow link between them costs little.

    exchange.py    how the replicas average what they send (gloo's all-reduce or the course's
                   own, optionally in bf16), and the bytes it costs
    survivors.py   when a replica dies: heartbeats, agreeing on who is left, a group of theirs
    checks.py      what is refused at construction, before any message leaves
    local_sgd.py   LocalSGD: average the parameters every H optimizer steps
    diloco.py      DiLoCo: average the pseudo-gradient θ_global − θ_local every H inner steps
                   and take an outer optimizer step on it; Streaming DiLoCo, fragment by fragment

Both run over one process group: the whole job, or the "diloco" axis of a mesh whose other axes
parallelise each replica.
"""

from miniddp.local_sgd.diloco import DiLoCo
from miniddp.local_sgd.local_sgd import LocalSGD

__all__ = ["DiLoCo", "LocalSGD"]
