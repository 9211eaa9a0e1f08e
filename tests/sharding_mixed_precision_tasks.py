"""What the ranks of the test pool run for tests/test_sharding_mixed_precision.py: the model of
tests/sharding_fsdp_tasks.py under a mixed-precision policy, with miniddp.fully_shard and with
torch's fully_shard (FSDP2), both with AdamW, on the same data.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from miniddp import full_state_dict, fully_shard
from miniddp.collectives import traffic
from miniddp.sharding import MixedPrecisionPolicy
from miniddp.sharding.units import UNIT_OF
from tests.sharding_fsdp_tasks import FsdpSpec, batch, build_model


def shard(kind: str, model: nn.Sequential, policy: dict) -> nn.Module:
    """Every Linear, then the root, each with the same policy (`policy`: its fields)."""
    if kind == "ours":
        apply, mp_policy = fully_shard, MixedPrecisionPolicy(**policy)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
        from torch.distributed.fsdp import fully_shard as apply

        mp_policy = TorchPolicy(**policy)
    for layer in model:
        if isinstance(layer, nn.Linear):
            apply(layer, mp_policy=mp_policy)
    return apply(model, mp_policy=mp_policy)


def full_gradients(kind: str, model: nn.Module) -> list[torch.Tensor]:
    """Every rank's gradient shards, gathered to the parameters' shapes."""
    if kind == "torch":
        return [p.grad.full_tensor().clone() for p in model.parameters()]
    grads = []
    for shard in model.parameters():
        unit = UNIT_OF[shard]
        index = next(i for i, s in enumerate(unit.shards) if s is shard)
        grads.append(unit.unshard(shard.grad, unit.shapes[index]))
    return grads


def full_parameters(kind: str, model: nn.Module) -> list[torch.Tensor]:
    if kind == "torch":
        return [t.full_tensor().detach().clone() for t in model.state_dict().values()]
    return [t.clone() for t in full_state_dict(model).values()]


def train(kind: str, spec: FsdpSpec, policy: dict) -> dict:
    """Per step: the forward's output, the full gradients, the full parameters after AdamW,
    the bytes this rank sent; and the dtypes seen inside the forward and outside it."""
    model = shard(kind, build_model(spec), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    inside: dict[str, torch.dtype] = {}

    def look_inside(layer: nn.Module, args: tuple) -> None:  # after fully_shard's own hook
        inside.update(weight=layer.weight.dtype, input=args[0].dtype)

    model[0].register_forward_pre_hook(look_inside)
    model[0].register_forward_hook(lambda _, __, out: inside.update(output=out.dtype))
    outputs, grads, params, sent = [], [], [], []
    for step in range(spec.steps):
        x, y = batch(spec, dist.get_rank(), step, 0)
        traffic.reset()
        output = model(x)
        nn.functional.mse_loss(output.float(), y).backward()
        sent.append(traffic.bytes_sent)
        outputs.append(output.detach().clone())
        grads.append(full_gradients(kind, model))
        grad_dtypes = {p.grad.dtype for p in model.parameters()}
        optimizer.step()
        optimizer.zero_grad()
        params.append(full_parameters(kind, model))
    shards = list(model.parameters())
    outside = {
        "shards": {p.dtype for p in shards},
        "grads": grad_dtypes,
        "optimizer state": {
            t.dtype for s in optimizer.state.values() for t in s.values() if t.dim() > 0
        },
    }
    return {
        "outputs": outputs,
        "grads": grads,
        "params": params,
        "sent": sent,
        "inside": inside,
        "outside": outside,
        "shard_elements": sum(p.numel() for p in shards),
    }


def against_torch(spec: FsdpSpec, policy: dict) -> dict:
    return {kind: train(kind, spec, policy) for kind in ("ours", "torch")}


def two_dtypes_in_one_unit(spec: FsdpSpec) -> dict:
    """One unit holding an fp32 and an fp64 layer, under a bf16 policy, beside the same model
    all in fp32: both compute in bf16 from the same bf16 values, so their outputs and gradients
    match, each gradient in its own master's dtype."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    results = {}
    for name in ("mixed", "fp32"):
        model = build_model(replace(spec, widths=(5, 8, 3)))
        if name == "mixed":
            model[2].double()
        fully_shard(model, mp_policy=policy)
        x, y = batch(spec, dist.get_rank(), 0, 0)
        output = model(x)
        nn.functional.mse_loss(output.float(), y).backward()
        results[name] = {"output": output.detach(), "grads": [p.grad for p in model.parameters()]}
    return results


def a_child_in_another_dtype(child_policy: dict, parent_policy: dict) -> None:
    model = build_model(FsdpSpec())
    fully_shard(model[0], mp_policy=MixedPrecisionPolicy(**child_policy))
    fully_shard(model, mp_policy=MixedPrecisionPolicy(**parent_policy))
    model(torch.randn(2, 5)).float().sum().backward()


def train_fp16_scaled(kind: str, spec: FsdpSpec, policy: dict, scaler_options: dict) -> dict:
    """`train` in float16 with a loss scaler: ours ShardedGradScaler, torch's fully_shard
    torch.amp.GradScaler (its DTensor gradients agree on an overflow by themselves). Per step
    the scale, the full unscaled gradients and the full parameters after AdamW."""
    from miniddp.sharding import ShardedGradScaler

    unsynced = kind == "ours, torch.amp.GradScaler"  # the planted bug: the ranks never agree
    kind = "ours" if unsynced else kind
    model = shard(kind, build_model(spec), policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    make = ShardedGradScaler if kind == "ours" and not unsynced else torch.amp.GradScaler
    scaler = make("cpu", **scaler_options)
    scales, grads, params = [], [], []
    for step in range(spec.steps):
        x, y = batch(spec, dist.get_rank(), step, 0)
        loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grads.append(full_gradients(kind, model))
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        params.append(full_parameters(kind, model))
    return {"scales": scales, "grads": grads, "params": params}


def fp16_against_torch(spec: FsdpSpec, policy: dict, scaler_options: dict) -> dict:
    return {
        kind: train_fp16_scaled(kind, spec, policy, scaler_options) for kind in ("ours", "torch")
    }
