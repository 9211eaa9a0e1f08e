"""The bytes a forward leaves behind for its backward: activation memory, measured.

Autograd keeps, from the forward to the backward, every tensor an op saves to compute its
gradient: a Linear its input, GELU its input, a LayerNorm its input and its per-row mean and
1/std, attention its q, k, v and more. `torch.autograd.graph.saved_tensors_hooks` shows each
as it is saved (its pack hook), so inside `with SavedActivations(model, layers) as held:` every
saved tensor is seen, and counted:

    by storage, once       q, k and v are three views of one qkv output: one storage; a tensor
                           saved by two ops (log_softmax's output, which nll_loss saves too)
                           costs its bytes once, in the first layer that saved it
    at the end of forward  a storage's size is read when the `with` ends, not when saved: a
                           full parameter that fully_shard gathered for the forward and freed
                           after it (its storage resized to 0) is held by the graph for nothing
    parameters left out    a Linear saves its weight (weight.t(), a view): the model's own
                           memory, counted by miniddp.sharding.measure_memory, not here. So are
                           the storages of `model.parameters()`, views of them included, read
                           at the `with` and again as the model's forward begins: under mixed
                           precision the parameters are then the bf16 compute copies
    per layer              each tensor goes to the innermost of `layers` whose forward was
                           running when it was saved (one per transformer block, say), and to
                           "other" outside all of them: the embedding, the head, the loss

torch.utils.checkpoint(use_reentrant=False) saves its region's inputs through the same hooks
(it keeps them to run the region again in backward) and, inside the region, pushes a hook of
its own that saves nothing: a checkpointed block is measured as what it really keeps.

SavedActivations reads what one forward left at its end. A pipeline holds several microbatches'
at once and frees each after its backward: PeakSavedActivations follows every saved storage
while it lives, through the whole step, and keeps the most held at once (chapter 16's 1F1B).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import nn

OTHER = "other"  # what no layer's forward saved


class SavedActivations:
    """Count the bytes autograd saves for backward inside `with`; afterwards `by_layer` maps
    each of `layers`' names (then "other") to its bytes, and `total` sums them."""

    def __init__(self, model: nn.Module, layers: Mapping[str, nn.Module] | None = None) -> None:
        self.model = model
        self.layers = dict(layers or {})
        self.by_layer: dict[str, int] = {}
        self._running: list[str] = []  # the layers whose forward is running, innermost last
        self._owner: dict[int, str] = {}  # id(storage) -> the layer that saved it first
        self._storages: dict[int, torch.UntypedStorage] = {}  # held, so an id is never reused
        self._handles: list[Any] = []
        self._parameters: dict[int, torch.UntypedStorage] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    @property
    def total(self) -> int:
        return sum(self.by_layer.values())

    def __enter__(self) -> SavedActivations:
        if self._hooks is not None:
            raise RuntimeError("SavedActivations is already measuring: one `with` at a time")
        self._parameters, self._owner, self._storages, self._running = {}, {}, {}, []
        self._note_parameters()
        self._handles.append(self.model.register_forward_pre_hook(self._note_parameters))
        for name, layer in self.layers.items():
            self._handles += [
                layer.register_forward_pre_hook(lambda *_, name=name: self._enter(name)),
                layer.register_forward_hook(lambda *_: self._leave()),
            ]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(kind, error, traceback)
        self._hooks = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        totals = dict.fromkeys([*self.layers, OTHER], 0)
        for key, storage in self._storages.items():
            totals[self._owner[key]] += storage.nbytes()  # now: freed storages count 0
        self.by_layer = totals
        self._storages, self._owner, self._parameters = {}, {}, {}  # hold nothing past here

    def _note_parameters(self, *_: Any) -> None:
        for parameter in self.model.parameters():
            storage = parameter.untyped_storage()
            self._parameters[id(storage)] = storage

    def _enter(self, layer: str) -> None:
        self._running.append(layer)

    def _leave(self) -> None:
        self._running.pop()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = id(storage)  # one Python object per storage: views share it
        if key not in self._parameters and key not in self._storages:
            self._storages[key] = storage
            self._owner[key] = self._running[-1] if self._running else OTHER
        return tensor


class PeakSavedActivations:
    """The most bytes autograd holds for backward at once, over forwards and backwards that
    overlap (a pipeline's microbatches in flight), parameters left out. Inside `with`, each
    storage is counted once while any saved reference to it lives; a reference dies with the
    graph that saved it, after its backward. `peak` is the high-water mark, `now` the bytes
    held. `parameters`: the storages to leave out (under mixed precision, the compute copies
    too)."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, saved references]
        self.now = self.peak = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def __enter__(self) -> PeakSavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exception: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exception)
        self._hooks = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.parameters or not storage.nbytes():
            return tensor
        if key not in self.live:
            self.live[key] = [storage.nbytes(), 0]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.live[key][1] += 1
        return _Saved(tensor, key, self)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if not entry[1]:
            self.now -= entry[0]
            del self.live[key]


class _Saved:
    """A saved tensor, handed back to autograd; freed with the graph, it tells its counter."""

    def __init__(self, tensor: torch.Tensor, key: int, counter: PeakSavedActivations) -> None:
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self) -> None:
        self.counter.release(self.key)


def _unpack(saved: Any) -> torch.Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved
