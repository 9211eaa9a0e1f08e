"""A linear layer split by columns or by rows across the tensor-parallel group (Megatron, §3).

Write the layer as Y = X A^T + b with A of shape (out, in) (nn.Linear's convention):

    colwise   rank r keeps the rows A_r = chunk(A, W, 0)[r] (its output columns) and b_r:
              Y_r = X A_r^T + b_r is this rank's slice of Y's last dimension. No talking forward;
              X enters through f, so backward sums the ranks' parts of dL/dX.
    rowwise   rank r keeps A_r = chunk(A, W, 1)[r] (its input columns) and receives X_r, its
              slice of X's last dimension (a colwise layer's output): X A^T = sum_r X_r A_r^T.
              The partial products leave through g (the all-reduce); b is added once, after it,
              so it is counted once, not W times, and its gradient is the full dL/dY everywhere.

colwise then rowwise needs no communication between them, because the activation in between
(GELU, or attention per head) acts on each slice alone. That is the whole trick.

Both keep nn.Linear's names (weight, bias) so a state_dict or an optimizer sees the same keys,
with each rank's tensors its shards. in_features/out_features are the local sizes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from miniddp.tensor_parallel.communications import (
    copy_to_tensor_parallel,
    reduce_from_tensor_parallel,
)
from miniddp.tensor_parallel.shards import local_parameter


class ColwiseLinear(nn.Module):
    """This rank's output columns of an nn.Linear; its output is sharded on the last dim."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None, name: str) -> None:
        super().__init__()
        self.group = group
        self.weight = local_parameter(linear.weight, 0, group, f"{name}.weight")
        self.bias = None
        if linear.bias is not None:
            self.bias = local_parameter(linear.bias, 0, group, f"{name}.bias")
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tensor_parallel(x, self.group), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, local out_features={self.out_features}"


class RowwiseLinear(nn.Module):
    """This rank's input rows of an nn.Linear; takes a sharded input, returns the full output."""

    def __init__(self, linear: nn.Linear, group: dist.ProcessGroup | None, name: str) -> None:
        super().__init__()
        self.group = group
        self.weight = local_parameter(linear.weight, 1, group, f"{name}.weight")
        self.bias = linear.bias  # replicated: every rank keeps it whole
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tensor_parallel(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"local in_features={self.in_features}, out_features={self.out_features}"
