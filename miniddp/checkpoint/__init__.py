"""Checkpoints that resume a job exactly, whatever parallelism it trains with (floor 3: it knows
every parallelism's state, through the marks they leave and their full-state functions).

    save_load.py     save_checkpoint / load_checkpoint: atomic, complete, a bit-identical
                     resume; who writes what, and the meeting points every rank must reach
    full_tensors.py  a tensor-parallel or pipelined model's state whole for the file, and each
                     rank's part cut back out on load
    file.py          the file format: written whole or not at all, read without running code

    from miniddp.checkpoint import Progress, load_checkpoint, save_checkpoint
"""

from miniddp.checkpoint.file import FORMAT, RNG_FORMAT, VERSION, CheckpointError, Progress
from miniddp.checkpoint.save_load import (
    LoadedCheckpoint,
    capture_rng_state,
    load_checkpoint,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
)

__all__ = [
    "FORMAT",
    "RNG_FORMAT",
    "VERSION",
    "CheckpointError",
    "LoadedCheckpoint",
    "Progress",
    "capture_rng_state",
    "load_checkpoint",
    "read_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]
