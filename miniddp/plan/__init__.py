"""miniddp.plan: from a laptop to 16,000 GPUs. A layout's memory and step time, term by term,
from the formulas the chapters verify, with a GPU's constants in place of this machine's.

    python -m miniddp.plan --model llama3-70b --seq 8192 --global-batch 512 --gpus 1024 --gpu h100
    python -m miniddp.plan --model gpt3-175b --seq 2048 --global-batch 1536 --gpus 1024 \\
        --gpu a100 --layout tp=8,pp=8,cp=1,dp=16 --json plan.json

The vocabulary: a *layout* cuts N GPUs as tp·pp·cp·dp (layout.py); a *term* is one part of
memory or time with its source (terms.py); a *plan* is a layout evaluated (search.py). Files,
in reading order:

    shapes.py        a transformer's shape, the presets, parameters and FLOPs (both counts)
    clusters.py      GPUs, nodes, networks and software, every assumption written down
    layout.py        a layout, parsed from tp=8,pp=16,...; what cannot run is refused
    terms.py         a term: value, why, and the library function (and chapter) behind it
    memory_terms.py  parameters, gradients, optimizer state, activations, buffers
    time_terms.py    compute, bubble, TP, CP, PP, DP (each with what compute hides), optimizer
    search.py        evaluate one layout; search all; why the best wins
    calibrate.py     the two constants per GPU, fitted on the development set only
    __main__.py      the command line: a table, --json, --plot (figure.py draws it)

Checked twice: tests/test_plan.py holds each term to the library function a chapter verifies
(and catches a planted error in three of them); tests/test_plan_published.py holds the plan to
18 published runs it was not fitted on. `python -m miniddp.bench plan` sets it beside steps
measured on this machine.

Nothing here is a second copy of a formula: the bubble is pipeline.bubble's, the bytes of
memory sharding.memory's, the activations gpt_activations', collectives cost_model's, the
overlap observe.overlap_model's, the ring's context_parallel's. A term no chapter verifies says
so in its source.
"""

from miniddp.plan.clusters import Cluster, load_cluster
from miniddp.plan.layout import BadLayout, Layout, Partial, parse_layout
from miniddp.plan.search import Plan, evaluate, search
from miniddp.plan.shapes import PRESETS, Transformer

__all__ = [
    "PRESETS",
    "BadLayout",
    "Cluster",
    "Layout",
    "Partial",
    "Plan",
    "Transformer",
    "evaluate",
    "load_cluster",
    "parse_layout",
    "search",
]
