"""torchft's DiLoCo (torchft 0.2.0) on tests/local_sgd_tasks.py's model and data: W replicas as
threads of one process, each with its own Manager, all meeting at a lighthouse on 127.0.0.1,
init_sync=False. tests/test_local_sgd.py runs it in a subprocess, to keep torchft's threads and
servers out of the test process:

    python -m tests.torchft_reference OUT.pt SPEC...   # each spec's replicas' parameters
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from tests.local_sgd_tasks import (
    Spec,
    batch,
    build_model,
    fragments_of,
    inner_optimizer,
    outer_optimizer,
    params_of,
)

TIMEOUT = timedelta(seconds=30)


def replica(spec: Spec, index: int, lighthouse: str, initial: dict) -> list[torch.Tensor]:
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model = build_model(spec)
    model.load_state_dict(initial)
    inner = inner_optimizer(spec, model.parameters())
    fragments = fragments_of(model, spec.fragments)
    outers = [outer_optimizer(spec, f.parameters()) for f in fragments]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        min_replica_size=spec.replicas,
        use_async_quorum=False,
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        replica_id=str(index),
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        hostname="127.0.0.1",
        port=0,
        init_sync=False,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
    )
    try:
        with DiLoCo(
            manager, fragments, inner, outers, spec.sync_every, fragment_sync_delay=spec.delay
        ):
            for step in range(spec.inner_steps):
                x, y = batch(spec, index, step)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
        return params_of(model)
    finally:
        manager.shutdown(wait=False)


def run(spec: Spec) -> list[list[torch.Tensor]]:
    from torchft._torchft import LighthouseServer

    torch.set_num_threads(1)
    initial = build_model(spec).state_dict()  # built once: threads share the global generator
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=spec.replicas)
    try:
        with ThreadPoolExecutor(spec.replicas) as pool:
            runs = [
                pool.submit(replica, spec, i, lighthouse.address(), initial)
                for i in range(spec.replicas)
            ]
            return [r.result() for r in runs]
    finally:
        lighthouse.shutdown()


if __name__ == "__main__":
    specs = [eval(given, {"Spec": Spec}) for given in sys.argv[2:]]
    torch.save([run(spec) for spec in specs], sys.argv[1])
