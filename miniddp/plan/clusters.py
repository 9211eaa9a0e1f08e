"""The machines: a GPU, its node, its network, and the software that ran on it, as numbers.

A preset is a GPU *and* the training software of the published runs it is checked against
(published.py): a100 is Selene running Megatron-LM in 2021, h100 is Eos (and Meta's clusters)
running Megatron-Core in 2024. Every number below is an assumption, written down:

    peak_flops       dense bf16/fp16 tensor-core FLOP/s, no sparsity: A100 312 T, H100 SXM 989 T
                     (NVIDIA's data sheets; the MFU the sources print divides by these)
    memory_gib       80 GiB: the A100 80GB (Selene) and the H100 SXM; all of it usable
    hbm_bandwidth    A100 80GB 2.0 TB/s, H100 SXM 3.35 TB/s (data sheets): memory-bound kernels
    gpus_per_node    8, every GPU of a node on NVLink (DGX A100, DGX/HGX H100, Grand Teton)
    nvlink_bandwidth what a ring collective inside a node gets, per GPU and each way: NCCL's bus
                     bandwidth on DGX A100 (about 230 GB/s of NVLink 3's 300) and on H100 (about
                     360 GB/s of NVLink 4's 450)
    network_bandwidth between nodes, per GPU, each way: one 200 Gb/s HDR NIC a GPU on Selene
                     (25 GB/s, about 23 achieved), one 400 Gb/s NDR or RoCE NIC a GPU on Eos and
                     on Llama 3's clusters (50 GB/s, about 45 achieved). Per GPU, not per node:
                     the fabric is rail-optimised and NCCL runs one ring per rail, so a
                     collective over GPUs of other nodes gets its own NIC's bandwidth
    *_latency        alpha per step of a ring collective: 1 us inside a node, 5 us across
                     (NCCL pipelines a ring's steps: a small all-reduce on 8 NVLink GPUs takes
                     about 15 us in all, 14 steps; across nodes a few us a hop more)
    collective_overhead  LogP's o: the host's own time per collective or send, which no overlap
                     hides (observe.overlap_model's overhead_s; chapter 11 measures it on the
                     link). 0 for the GPUs: microseconds there, carried by the fitted constants;
                     `bench plan` measures it on this machine
    alpha_once       False: alpha is paid at every step of a ring (NCCL's); True: once a
                     collective, as the simulated link charges it (miniddp/observe/link.py)
    layer_overhead   the host's seconds a layer and microbatch, forward and backward, that no
                     FLOP count sees: Python and torch's dispatch of a block's few dozen ops.
                     0 for the GPUs (the host runs ahead of the kernels it launches); on this
                     machine's toy shapes it is most of a layer's time, and `bench plan`
                     measures it (one block at a tiny shape)
    ends_overhead    the same a microbatch for what lies outside the layers: the embedding, the
                     last norm, the output layer and the loss. 0 for the GPUs; `bench plan`
                     measures it (a GPT of one block at a tiny shape, less one block)
    reserved_gib     memory the training never gets: CUDA's context, cuBLAS's and NCCL's
                     workspaces, the allocator's fragmentation, 3 GiB in all

What the software did (each source says so in its text; the plan models it, no chapter here
measures it on a GPU):

    causal_half      a flash kernel skips the masked half of causal scores (2024: yes; 2021:
                     Megatron's fused softmax computed all s² scores)
    overlap          Megatron-Core 2024 overlaps DP's reduce-scatter with backward, its param
                     all-gather with forward and PP's sends with compute; Megatron-LM 2021
                     overlapped none of them
    tp_overlap       TP's collectives split into chunks that travel under the GEMMs (Megatron-
                     Core's --tp-comm-overlap, 2024); Llama 3's paper describes no such overlap,
                     so its runs keep TP's collectives exposed
    element_bytes    bytes of an activation as the runs compute and send it (TP's and PP's
                     messages, CP's K/V, the gathered parameters): 2, bf16, on the GPUs; 4 on
                     this machine, whose `bench plan` runs in float32
    grad_bytes       bytes an element of the gradient DP reduces: 4 in 2024 (bf16 training
                     reduces fp32 main grads); 2 in 2021 (the fp16 scripts of the time did not
                     pass --accumulate-allreduce-grads-in-fp32: fp16 gradients all-reduced)
    cp_all_gather    context parallelism all-gathers K/V before attending (Llama 3's, Grattafiori
                     et al. 2024, section 3.3.2) instead of passing them round a ring (MiniDDP's
                     and Megatron-Core's): the transfer is then never hidden under the scores
    sequence_parallel  Korthikanti et al.'s sequence parallelism and selective recomputation
                     (Megatron 2022 on): 2024 yes; 2021 no, so its activations keep the
                     replicated 10·sbh a layer and its only recomputation is full
    context_parallel the sequence split over a ring: 2024 yes, 2021 no
    max_zero         the highest ZeRO stage the software has: 2021's Megatron none (0);
                     Megatron-Core 2024 its distributed optimizer (1); Llama 3's FSDP kept the
                     parameters after forward (2); a JSON cluster may allow 3 (fully_shard)
    sharded_masters  Megatron-Core's distributed optimizer (2024, and Llama 3's training) shards
                     the fp32 masters with Adam's states, as ZeRO's paper does: 12Ψ/d, not
                     MiniDDP's ZeRO-1, which keeps them whole (Formula's 4Ψ + 8Ψ/d). 2021: none

And the two constants fitted per GPU (calibrate.py, on the development set only):

    matmul_efficiency  the fraction of peak_flops large bf16 GEMMs reach
    memory_passes      memory-bound kernels' time per layer, in passes over the layer's saved
                       activations at hbm_bandwidth (LayerNorm, GELU, softmax, dropout, adds)

`cpu` is this machine, measured (`measured_cpu`): a matmul's FLOP/s at chapter 12's shapes and
chapter 16's simulated link for every collective (chapter 16 sets it to the model's scale).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from pathlib import Path

GB = 1e9
TERA = 1e12
GiB = 1024**3


@dataclass(frozen=True)
class Cluster:
    """A GPU model, its node and network, its software, and the two fitted constants."""

    name: str
    peak_flops: float
    memory_gib: float
    hbm_bandwidth: float
    gpus_per_node: int
    nvlink_bandwidth: float
    network_bandwidth: float
    nvlink_latency: float = 1e-6
    network_latency: float = 5e-6
    reserved_gib: float = 3.0
    collective_overhead: float = 0.0
    alpha_once: bool = False
    layer_overhead: float = 0.0
    ends_overhead: float = 0.0
    causal_half: bool = True
    overlap: bool = True
    tp_overlap: bool = True
    element_bytes: int = 2
    grad_bytes: int = 4
    sharded_masters: bool = False
    cp_all_gather: bool = False
    sequence_parallel: bool = True
    context_parallel: bool = True
    max_zero: int = 3
    matmul_efficiency: float = 0.6
    memory_passes: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"cluster {self.name!r}: {field.name} must be >= 0, got {value}")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(
                f"cluster {self.name!r}: matmul_efficiency is a fraction of peak, in (0, 1], "
                f"got {self.matmul_efficiency}"
            )

    @property
    def memory_bytes(self) -> float:
        """What training may use: the GPU's memory less `reserved_gib`."""
        return (self.memory_gib - self.reserved_gib) * GiB

    def link(self, group: int, stride: int) -> tuple[float, float]:
        """(latency, bandwidth) of a collective over `group` GPUs `stride` ranks apart: NVLink
        when the whole group sits in one node, the network otherwise."""
        if group * stride <= self.gpus_per_node:
            return self.nvlink_latency, self.nvlink_bandwidth
        return self.network_latency, self.network_bandwidth


# The constants from calibrate.py's fit (tests/test_plan_published.py refits and compares).
A100 = Cluster(
    "a100",
    peak_flops=312 * TERA,
    memory_gib=80,
    hbm_bandwidth=2.0e12,
    gpus_per_node=8,
    nvlink_bandwidth=230 * GB,
    network_bandwidth=23 * GB,
    causal_half=False,
    overlap=False,
    tp_overlap=False,
    grad_bytes=2,
    max_zero=0,
    sequence_parallel=False,
    context_parallel=False,
    matmul_efficiency=0.6592,
    memory_passes=5.123,
)
H100 = Cluster(
    "h100",
    peak_flops=989 * TERA,
    memory_gib=80,
    hbm_bandwidth=3.35e12,
    gpus_per_node=8,
    nvlink_bandwidth=360 * GB,
    network_bandwidth=45 * GB,
    causal_half=True,
    overlap=True,
    sharded_masters=True,
    max_zero=1,
    matmul_efficiency=0.5709,
    memory_passes=18.702,
)
PRESETS = {"a100": A100, "h100": H100}


def measured_cpu(link_alpha: float = 100e-6, link_bandwidth: float = 1e6 / 8) -> Cluster:
    """This machine: one process's float32 matmul FLOP/s at chapter 12's shapes (a 64-token
    window of width 128 against a 128 x 512 weight, the MLP's), and chapter 16's simulated link
    (alpha = 100 us, 1 Mbit/s) inside and between "nodes" alike. Memory: what psutil-free
    Python can read, the physical pages; the CPU has no HBM term (memory_passes 0)."""
    import os

    import torch

    x, w = torch.randn(16 * 64, 128), torch.randn(128, 512)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(10):
            x @ w
        best = min(best, (time.perf_counter() - start) / 10)
    flops = 2 * x.shape[0] * 128 * 512 / best
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return cpu_cluster("cpu", flops, link_alpha, link_bandwidth, memory_gib=pages / GiB)


def cpu_cluster(name: str, flops: float, alpha: float, bandwidth: float, **more) -> Cluster:
    """CPU ranks as the plan sees them: every matmul at `flops` (measured, so efficiency 1),
    one simulated link (alpha, bandwidth) inside and between "nodes" alike, no HBM term, no
    overlap of communication with compute. `more`: the fields a caller sets besides."""
    fields = dict(
        memory_gib=1024.0,
        reserved_gib=0.0,
        hbm_bandwidth=10 * GB,
        gpus_per_node=8,
        nvlink_bandwidth=bandwidth,
        network_bandwidth=bandwidth,
        nvlink_latency=alpha,
        network_latency=alpha,
        causal_half=False,
        overlap=False,
        tp_overlap=False,
        matmul_efficiency=1.0,
    )
    return Cluster(name, peak_flops=flops, **(fields | more))


def load_cluster(text: str) -> Cluster:
    """A preset's name (a100, h100, cpu) or a JSON file of Cluster's fields."""
    if text in PRESETS:
        return PRESETS[text]
    if text == "cpu":
        return measured_cpu()
    path = Path(text)
    if not path.is_file():
        raise ValueError(
            f"--gpu {text!r} is neither a preset ({', '.join([*PRESETS, 'cpu'])}) nor a JSON "
            "file: give one of those, or a file with the fields of miniddp.plan.Cluster"
        )
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"--gpu {text}: not JSON ({error})") from None
    known = {field.name for field in fields(Cluster)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"--gpu {text}: unknown fields {unknown}; the fields are {sorted(known)}")
    try:
        return Cluster(**values)
    except TypeError as error:
        raise ValueError(f"--gpu {text}: {error}") from None
