"""A checkpoint that is broken, foreign, malicious or from another model is a clear error
naming the file and the problem, and changes nothing: never code run from the file, never a
traceback from inside pickle, never a model half overwritten.

All but the last test run in this process without a process group (the library then acts as
one rank).
"""

from __future__ import annotations

import io
import os
import random
import re
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from miniddp.checkpoint import (
    FORMAT,
    CheckpointError,
    Progress,
    load_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from tests import checkpoint_tasks
from tests.harness.pool import RankPool


def new_training(widths: tuple[int, ...] = (4, 16, 1)) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    model = nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def everything_load_could_change(model: nn.Module, optimizer: torch.optim.Optimizer) -> list:
    parameters = [p.detach().clone() for p in model.parameters()]
    return [parameters, repr(optimizer.state_dict()), torch.get_rng_state(), random.getstate()]


def unchanged(before: list, after: list) -> bool:
    (params_before, *rest_before), (params_after, *rest_after) = before, after
    same_params = all(torch.equal(a, b) for a, b in zip(params_before, params_after))
    same_rng = torch.equal(rest_before[1], rest_after[1]) and rest_before[2] == rest_after[2]
    return same_params and rest_before[0] == rest_after[0] and same_rng


class RunsCodeWhenUnpickled:
    """A payload that creates `marker` when unpickled by plain pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


class RunsAShellCommandWhenUnpickled:
    def __reduce__(self):
        return (os.system, ("true",))


class PlainObject:
    pass


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        (RunsAShellCommandWhenUnpickled(), "Trying to load unsupported GLOBAL posix.system"),
        (PlainObject(), r"Unsupported global: GLOBAL [\w.]*PlainObject was not an allowed"),
    ],
    ids=["os.system", "an object of a class"],
)
def test_refusal_names_what_was_refused(tmp_path: Path, payload: object, refused: str) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"format": FORMAT, "version": 1, "model": payload}, path)
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(path)
    detail = str(raised.value).split("could do anything): ", 1)[1]
    assert re.match(refused, detail), str(raised.value)


def test_weights_only_refuses_to_run_code_from_the_file(tmp_path: Path) -> None:
    path, marker = tmp_path / "checkpoint.pt", tmp_path / "code-ran"
    torch.save({"format": FORMAT, "version": 1, "model": RunsCodeWhenUnpickled(marker)}, path)
    with pytest.raises(CheckpointError, match="weights_only") as raised:
        read_checkpoint(path)
    assert str(path) in str(raised.value)
    assert not marker.exists(), "loading the checkpoint ran code from it"
    torch.load(path, weights_only=False)  # the payload is real: a plain load runs it
    assert marker.exists()


def write_checkpoint(path: Path) -> None:
    model, optimizer = new_training()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()  # so that Adam has state to save
    save_checkpoint(path, model, optimizer, Progress(1, 0, 1))


def truncate(path: Path) -> None:
    write_checkpoint(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_bit_inside_a_tensor(path: Path) -> None:
    write_checkpoint(path)
    with zipfile.ZipFile(path) as archive:
        record = next(info for info in archive.infolist() if "/data/" in info.filename)
    data = bytearray(path.read_bytes())
    start = record.header_offset + 30 + len(record.filename.encode()) + len(record.extra)
    data[start + record.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def foreign_torch_file(path: Path) -> None:
    torch.save(nn.Linear(4, 16).state_dict(), path)


def newer_format(path: Path) -> None:
    torch.save({"format": FORMAT, "version": 99}, path)


def progress_with_an_extra_key(path: Path) -> None:
    write_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["progress"]["learning_rate"] = 0.1
    torch.save(checkpoint, path)


BROKEN_FILES: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing": (lambda path: None, "No checkpoint file at"),
    "empty": (lambda path: path.write_bytes(b""), "truncated or was not written by torch.save"),
    "truncated": (truncate, "truncated"),
    "bit flip": (flip_a_bit_inside_a_tensor, "does not match its checksum"),
    "text": (lambda path: path.write_text("step = 7\n"), "not written by torch.save"),
    "foreign torch file": (foreign_torch_file, "not a MiniDDP checkpoint"),
    "newer format": (newer_format, "format version 99"),
    "progress with an unexpected key": (
        progress_with_an_extra_key,
        "has a progress entry this MiniDDP does not read: ['batches_done', 'epoch', "
        "'learning_rate', 'step']",
    ),
}


@pytest.mark.parametrize("case", BROKEN_FILES)
def test_broken_file_is_a_clear_error_naming_it(tmp_path: Path, case: str) -> None:
    make, phrase = BROKEN_FILES[case]
    path = tmp_path / "checkpoint.pt"
    make(path)
    model, optimizer = new_training()
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, model, optimizer)
    message = str(raised.value)
    assert str(path) in message and phrase in message, message
    # No "During handling of the above exception..." from deep inside torch.load or pickle.
    error = raised.value
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def two_parameter_groups(model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    groups = [{"params": layer.parameters()} for layer in model]
    return model, torch.optim.Adam(groups, lr=0.01)


OTHER_MODELS = {
    # The first layer fits: a loader that goes layer by layer would overwrite it, then fail.
    "a layer of another shape": (
        lambda: new_training((4, 16, 2)),
        "'1.weight' has shape (1, 16) in the checkpoint and (2, 16) in this model",
    ),
    "one layer more": (
        lambda: new_training((4, 16, 1, 1)),
        "this model has '2.weight', '2.bias', which the checkpoint lacks",
    ),
    "one layer fewer": (
        lambda: new_training((4, 16)),
        "the checkpoint has '1.weight', '1.bias', which this model lacks",
    ),
    "an optimizer with two parameter groups": (
        lambda: two_parameter_groups(new_training()[0]),
        "the checkpoint's optimizer has 1 parameter groups and this one 2",
    ),
}


@pytest.mark.parametrize("case", OTHER_MODELS)
def test_checkpoint_of_another_model_names_the_problem_and_changes_nothing(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / "checkpoint.pt"
    write_checkpoint(path)
    make, problem = OTHER_MODELS[case]
    model, optimizer = make()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    before = everything_load_could_change(model, optimizer)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, model, optimizer)
    message = str(raised.value)
    assert f"{path} does not fit this model or optimizer: {problem}" in message, message
    assert "Nothing was loaded" in message
    assert unchanged(before, everything_load_could_change(model, optimizer))


def sgd_with_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.mark.parametrize(
    "saved_with, loaded_into, stepped",
    [(sgd_with_momentum, adamw, True), (sgd_with_momentum, adamw, False)]
    + [(adamw, sgd_with_momentum, False)],
    ids=["sgd-into-adamw", "sgd-into-a-fresh-adamw", "adamw-into-sgd"],
)
def test_a_checkpoint_of_another_optimizer_is_refused_before_anything_loads(
    tmp_path: Path, saved_with, loaded_into, stepped
) -> None:
    """The README's promise: checked before anything is loaded, nothing changes. Loaded as
    torch loads it, SGD's momentum buffers replace AdamW's state and its hyperparameters
    (then a KeyError 'step', with the weights already overwritten); AdamW's, loaded into SGD,
    leave groups without 'momentum', and the first step fails."""
    path = tmp_path / "checkpoint.pt"
    model, _ = new_training()
    optimizer = saved_with(model)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    save_checkpoint(path, model, optimizer, Progress(1, 0, 1))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 1))
    optimizer = loaded_into(model)
    if stepped:
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    before = everything_load_could_change(model, optimizer)
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(path, model, optimizer)
    message = str(raised.value)
    saved, here = type(saved_with(model)).__name__, type(optimizer).__name__
    assert f"the checkpoint's optimizer was another kind than this {here}" in message, message
    assert "Nothing was loaded" in message and "momentum" in message and "betas" in message
    assert unchanged(before, everything_load_could_change(model, optimizer)), saved


def test_map_location_decides_where_tensors_land(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    write_checkpoint(path)
    checkpoint = read_checkpoint(path, map_location="meta")
    assert {t.device.type for t in checkpoint["model"].values()} == {"meta"}


def test_every_rank_reports_a_corrupt_file(pool2: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    truncate(path)
    messages = pool2.run(checkpoint_tasks.load_expecting_error, str(path))
    assert all(str(path) in m and "truncated" in m for m in messages), messages


def test_torch_save_writes_the_checksums_that_loading_checks() -> None:
    """read_checkpoint relies on torch.save writing a zip archive with a CRC32 per record."""
    buffer = io.BytesIO()
    torch.save({"x": torch.ones(2)}, buffer)
    with zipfile.ZipFile(buffer) as archive:
        assert archive.testzip() is None


def test_one_ranks_shards_are_named_as_shards_cut_for_their_world_size(tmp_path: Path) -> None:
    """A fully sharded model's `state_dict()` saved from one rank (what save_checkpoint wrote
    before it saved the full state): its 1-D entries of ceil(n/W) elements read like another
    model's. The error says they are shards, for which W, and how to save the full state."""
    from miniddp.checkpoint.file import write_atomically

    path = tmp_path / "shards.pt"
    model, optimizer = new_training()
    shards = {
        key: value.reshape(-1)[: -(-value.numel() // 2)]
        for key, value in model.state_dict().items()
    }
    progress = {"step": 1, "epoch": 0, "batches_done": 1}
    checkpoint = {"format": FORMAT, "version": 1, "model": shards, "buckets": None, "extra": {}}
    checkpoint |= {"optimizer": optimizer.state_dict(), "progress": progress}
    checkpoint |= {"world_size": 2, "rng": [None, None]}
    write_atomically(checkpoint, path)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(path, model, allow_world_size_change=True)
    assert "'0.weight' has shape (32,) in the checkpoint and (16, 4) in this model" in str(
        caught.value
    )
    assert "a shard" in str(caught.value) and "cut for W = 2" in str(caught.value)
