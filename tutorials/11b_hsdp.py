"""Chapter 11b: HSDP. ZeRO-3 inside each node, DDP across nodes: fully_shard over a 2-D mesh.

    torchrun --nproc_per_node=4 tutorials/11b_hsdp.py     (NPROC=4 ./launch.sh ...)

Chapter 11's ZeRO-3 shards over every rank, so each of its gathers and reduce-scatters runs a
ring through every node, at the pace of the slowest hop. A cluster has two speeds: NVLink
inside a node, a network between nodes. HSDP (hybrid sharding: FSDP2's 2-D mesh, torchtitan's
dp_replicate x dp_shard, DeepSpeed's hpZ) shards inside the node and replicates across:

    1. the mesh              4 ranks as 2 nodes of 2: dim 0 replicates, dim 1 shards
    2. torch's bits          HSDP trains as torch's fully_shard over the same mesh, bit for bit
    3. the bytes per link    one step's messages, inside a node and across, per design,
                             against the formulas
    4. two speeds            a step over a simulated fast link inside and slow link across:
                             HSDP against ZeRO-3 over all four and against DDP
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from common import end_chapter, fmt_bytes, say, say_all_ranks, say_prose, section
from torch import nn

from miniddp import MiniDDP, full_state_dict, fully_shard
from miniddp.collectives import record_messages
from miniddp.data_parallel.default_hooks import all_reduce_hook
from miniddp.instruments.link_group import simulated_link
from miniddp.job.env import init_distributed
from miniddp.mesh import init_device_mesh
from miniddp.observe.link import Link, TwoSpeed, wire_bytes
from miniddp.sharding.units import UNIT_NUMBER_BYTES

R, S = 2, 2  # replicas (nodes) x shards (ranks per node)
N = R * S
WIDTHS = (64, 129, 128, 65, 8)  # chapter 11's MLP: sizes S rarely divides, so shards pad
STEPS = 3
INSIDE = Link.parse("alpha=20us,bandwidth=10gbit")  # NVLink, scaled to this machine
ACROSS = Link.parse("alpha=200us,bandwidth=100mbit")  # the network between nodes
UNITS, WIDTH, BATCH, LINK_STEPS = 4, 256, 128, 5  # section 4's chain; 2 untimed steps
DESIGNS = ("HSDP 2 x 2", "ZeRO-3 over 4", "DDP over 4")


def build_model(widths: tuple[int, ...]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(UNITS)])


def wrap(design: str, model: nn.Sequential, meshes: dict) -> nn.Module:
    """Every Linear a unit, then the root (FSDP2's usage); or MiniDDP on our ring."""
    if design == "DDP over 4":
        ddp = MiniDDP(model)
        ddp.register_comm_hook(None, all_reduce_hook("ring"))  # our ring: every byte counted
        return ddp
    mesh = meshes[design]
    if design == "torch's HSDP":
        from torch.distributed.fsdp import fully_shard as apply
    else:
        apply = fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            apply(layer, mesh=mesh)
    return apply(model, mesh=mesh)


def train(design: str, meshes: dict) -> list[torch.Tensor]:
    """STEPS AdamW steps on this rank's own data; the full parameters at the end."""
    model = wrap(design, build_model(WIDTHS), meshes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        model(torch.randn(16, WIDTHS[0], generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    if design == "torch's HSDP":
        return [t.full_tensor() for t in model.state_dict().values()]
    if design == "DDP over 4":
        return list(model.module.state_dict().values())
    return list(full_state_dict(model).values())


def bytes_per_link(design: str, meshes: dict) -> tuple[int, int]:
    """One step's bytes sent by the whole job, (inside a node, across nodes): each rank logs
    the messages it sends, and a message crosses when its two ranks sit in two nodes."""
    model = wrap(design, build_model(WIDTHS), meshes)
    with record_messages() as messages:
        model(torch.randn(16, WIDTHS[0])).pow(2).mean().backward()
    sent = torch.zeros(2, dtype=torch.int64)
    for message in messages:
        sent[int(message.src // S != message.dst // S)] += message.nbytes
    dist.all_reduce(sent)
    return int(sent[0]), int(sent[1])


def padded(shards: int, widths: tuple[int, ...]) -> int:
    """Elements of one rank's shards: every parameter cut in ceil(n / shards)."""
    sizes = [n for a, b in zip(widths, widths[1:]) for n in (a * b, b)]
    return sum(-(-n // shards) for n in sizes)


def formulas(widths: tuple[int, ...]) -> dict[str, tuple[float, float]]:
    """Bytes the job sends per step, (inside, across), elements of 4 bytes, U units.

    HSDP       every rank: 3(S-1) shard-sized chunks to its shard peer (two gathers, one
               reduce-scatter, each gather with its unit's 8-byte number), then its shard's
               all-reduce with its replica, 2(R-1)/R of a shard: across
    ZeRO-3     a ring through all N: each rank sends 3(N-1) chunks to the next; R of the N
               hops leave a node
    DDP        a ring all-reduce through all N: 2(N-1)/N·Ψ per rank, R of N hops across
    """
    units, psi = len(widths) - 1, padded(1, widths)
    hsdp_rank = 3 * (S - 1) * padded(S, widths) * 4 + 2 * units * (S - 1) * UNIT_NUMBER_BYTES
    zero3_rank = 3 * (N - 1) * padded(N, widths) * 4 + 2 * units * (N - 1) * UNIT_NUMBER_BYTES
    ddp_rank = 2 * (N - 1) / N * psi * 4
    return {
        "HSDP 2 x 2": (N * hsdp_rank, N * 2 * (R - 1) / R * padded(S, widths) * 4),
        "ZeRO-3 over 4": ((N - R) * zero3_rank, R * zero3_rank),
        "DDP over 4": ((N - R) * ddp_rank, R * ddp_rank),
    }


def link_seconds(design: str) -> tuple[float, float]:
    """Alpha-beta seconds per step on each link, (inside, across), for section 4's chain: the
    collectives each rank runs on it, each link.seconds(wire bytes) (link.py's wire model)."""
    unit = (WIDTH * WIDTH + WIDTH) * 4
    if design == "HSDP 2 x 2":
        shard = padded(S, (WIDTH, WIDTH)) * 4
        inside = 2 * INSIDE.seconds(wire_bytes("all_gather", shard, S))
        inside += INSIDE.seconds(wire_bytes("reduce_scatter", shard, S))
        return UNITS * inside, UNITS * ACROSS.seconds(wire_bytes("all_reduce", shard, R))
    if design == "ZeRO-3 over 4":
        shard = padded(N, (WIDTH, WIDTH)) * 4
        return 0.0, UNITS * 3 * ACROSS.seconds(wire_bytes("all_gather", shard, N))
    return 0.0, UNITS * ACROSS.seconds(wire_bytes("all_reduce", unit, N))  # a bucket a layer


def timed_step(design: str, meshes: dict) -> float:
    """LINK_STEPS steps of the chain over the two-speed link; the median of the timed ones."""
    model = chain()
    if design == "DDP over 4":
        model = MiniDDP(model, bucket_cap_mb=1.2 * (WIDTH + 1) * WIDTH * 4 / 2**20)
        model.register_comm_hook(None, all_reduce_hook("ring"))
    else:
        for layer in model:
            fully_shard(layer, mesh=meshes[design])
        fully_shard(model, mesh=meshes[design])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    times = []
    for _ in range(LINK_STEPS):
        dist.barrier()
        start = time.perf_counter()
        model(x).pow(2).mean().backward()
        times.append(time.perf_counter() - start)
        optimizer.step()
        optimizer.zero_grad()
    timed = sorted(times[2:])
    return timed[len(timed) // 2]


def refuse_other_world_sizes() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == N:
        return
    if os.environ.get("RANK", "0") == "0":
        raise SystemExit(
            f"Chapter 11b lays out 4 ranks as 2 nodes of 2, and this job has {world}: run it "
            "as torchrun --nproc_per_node=4 tutorials/11b_hsdp.py"
        )
    raise SystemExit(2)


def main() -> None:
    argparse.ArgumentParser(description="Chapter 11b: HSDP on 4 ranks.").parse_args()
    refuse_other_world_sizes()
    init_distributed()
    torch.set_num_threads(1)  # four ranks share this machine's cores
    from torch.distributed.device_mesh import init_device_mesh as torchs_mesh

    section("1. The mesh")
    names = ("replicate", "shard")
    mesh = init_device_mesh("cpu", (R, S), mesh_dim_names=names)
    meshes = {
        "HSDP 2 x 2": mesh,
        "torch's HSDP": torchs_mesh("cpu", (R, S), mesh_dim_names=names),
        "ZeRO-3 over 4": init_device_mesh("cpu", (N,), mesh_dim_names=("shard",)),
    }
    say_prose("""\
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) lays the ranks
        out as torch.arange(4).view(2, 2): a row is a node (torchrun numbers a node's ranks
        consecutively), a column holds one rank of each. fully_shard(module, mesh=mesh), as
        torch's, shards over dim 1 and replicates over dim 0, whatever their names:""")
    shard_ranks = dist.get_process_group_ranks(mesh.get_group("shard"))
    replicas = dist.get_process_group_ranks(mesh.get_group("replicate"))
    say_all_ranks(f"shards with {shard_ranks} (its node), replicates with {replicas}")
    say_prose("""\
        Each parameter is cut in S = 2, not in 4: a rank holds half the model, its gradient
        and Adam state, the same half as the rank below it. After each unit's backward, the
        reduce-scatter inside the node leaves each rank the average of its half over the node;
        an all-reduce over the column then averages that over the nodes. Two averages, each a
        sum and one division, in the order torch's FSDP2 runs them (reduce-scatter AVG, then
        all-reduce AVG): at 2 x 2 each halving is exact, so the bits match torch's.""")

    section("2. Torch's bits")
    runs = {design: train(design, meshes) for design in ("HSDP 2 x 2", "torch's HSDP")}
    ddp = train("DDP over 4", meshes)
    pairs = zip(runs["HSDP 2 x 2"], runs["torch's HSDP"], strict=True)
    bitwise = all(torch.equal(a, b) for a, b in pairs)
    from_ddp = max((a - b).abs().max().item() for a, b in zip(runs["HSDP 2 x 2"], ddp))
    say(f"  {STEPS} AdamW steps, every rank its own data: bit for bit torch's HSDP: {bitwise}")
    say(f"  largest difference from DDP over 4 (1/4 before one 4-term sum): {from_ddp:.1e}")

    section("3. The bytes on each link")
    say_prose(f"""\
        One step of each design, every message logged by its sender and sorted by whether its
        two ranks share a node; the whole job's bytes, beside the formulas (Ψ =
        {padded(1, WIDTHS):,} elements; shards padded to ceil(n/S) per parameter):""")
    expected = formulas(WIDTHS)
    say(f"  {'':<14} {'inside':>10} {'formula':>10}   {'across':>10} {'formula':>10}")
    measured = {}
    for design in DESIGNS:
        measured[design] = bytes_per_link(design, meshes)
        inside, across = measured[design]
        want_inside, want_across = expected[design]
        say(
            f"  {design:<14} {fmt_bytes(inside):>10} {fmt_bytes(want_inside):>10}   "
            f"{fmt_bytes(across):>10} {fmt_bytes(want_across):>10}"
        )
    say_prose("""\
        Across the nodes, per step: HSDP 2(R-1)·Ψ (each rank's 1/S shard, twice over R = 2:
        2Ψ), ZeRO-3 3R(N-1)/N·Ψ (4.5Ψ) and DDP 2R(N-1)/N·Ψ (3Ψ). HSDP keeps its gathers
        and reduce-scatters on the fast link and sends across only the reduced shards. Its
        price: half the model per rank instead of a quarter.""")

    section("4. A step over two speeds")
    say(f"  inside a node: {INSIDE}; across: {ACROSS} (miniddp.observe.link.TwoSpeed)")
    say_prose(f"""\
        A chain of {UNITS} Linear({WIDTH}, {WIDTH}) units, a batch of {BATCH}; a collective
        whose group spans both nodes crosses the slow link, the slowest hop of its ring. The
        alpha-beta time per step on each link (every unit's collectives, one after another),
        and the step measured (median of {LINK_STEPS - 2}; prefetch and DDP's buckets hide
        some of it under compute, and the compute of four ranks on this machine's cores adds
        its own):""")
    two_speed = TwoSpeed(INSIDE, ACROSS, ranks_per_node=S)
    steps = {}
    with simulated_link(two_speed):  # the groups made inside the block cross it: new meshes
        on_the_link = {
            "HSDP 2 x 2": init_device_mesh("cpu", (R, S), mesh_dim_names=names),
            "ZeRO-3 over 4": init_device_mesh("cpu", (N,), mesh_dim_names=("shard",)),
        }
        for design in DESIGNS:
            steps[design] = timed_step(design, on_the_link)
    modelled = {design: link_seconds(design) for design in DESIGNS}
    for design in DESIGNS:
        inside, across = modelled[design]
        say(
            f"  {design:<14} links: {inside * 1e3:5.1f} ms inside, {across * 1e3:5.1f} ms "
            f"across   step measured {steps[design] * 1e3:6.1f} ms"
        )
    say_prose(f"""\
        ZeRO-3's step over HSDP's: {steps["ZeRO-3 over 4"] / steps["HSDP 2 x 2"]:.2f}x here;
        DDP's over HSDP's: {steps["DDP over 4"] / steps["HSDP 2 x 2"]:.2f}x (timings move with
        this machine's load, the link times do not).""")

    section("Checks")
    exact = {d: measured[d] == tuple(int(b) for b in expected[d]) for d in DESIGNS[:2]}
    near_ddp = all(
        abs(m - e) <= 0.01 * e for m, e in zip(measured["DDP over 4"], expected["DDP over 4"])
    )
    assert bitwise, "HSDP must train as torch's fully_shard over the same mesh, bit for bit"
    assert from_ddp <= 1e-6, from_ddp
    assert all(exact.values()), f"bytes per link differ from the formula: {exact}"
    assert near_ddp, measured["DDP over 4"]
    across = {design: seconds for design, (_, seconds) in modelled.items()}
    assert across["HSDP 2 x 2"] < across["DDP over 4"] < across["ZeRO-3 over 4"]
    dist.barrier()
    say(
        "Verified on 4 ranks: HSDP trains as torch's, bit for bit; every byte on the link the "
        "formula puts it on; and across the nodes HSDP sends the least of the three."
    )
    end_chapter()


if __name__ == "__main__":
    main()
