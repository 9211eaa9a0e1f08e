"""Exercise 11 (chapter 14): GPipe's order, checked by the tests that hold miniddp's schedules.

A schedule is an order: for this stage, the list of actions Action("F", i) (the forward of
microbatch i) and Action("B", i) (its backward), each exactly once. Everything else (receiving
activations and gradients, sending them on, computing the loss on the last stage, dividing
.grad by m) is done by PipelineSchedule, in miniddp/pipeline/schedule.py. Fill in `order`, then:

    MINIDDP_PP_SCHEDULE=tutorials/exercises/gpipe.py:ScheduleGPipe \
        python -m pytest tests/test_pipeline.py -x -q

The tests train 2- and 4-stage pipelines with your schedule and compare every stage's gradients,
every microbatch's loss and the parameters after 3 SGD steps, bit for bit, with one process and
with torch's own ScheduleGPipe; and replay what each stage ran on a logical clock, where GPipe's
bubble is exactly (p - 1) / (m + p - 1). A wrong order is refused on every stage before any
message moves, saying why: an action missing or listed twice, a B before its F, or orders that
would wait for each other forever.

Then try 1F1B: stage s runs min(m, p - s) forwards, then one backward and one forward in turn.
Does the replay's bubble change? What does `peak_held` say? (Answer: miniddp/pipeline/schedule.py.)
"""

from __future__ import annotations

from miniddp.pipeline import Action, PipelineSchedule


class ScheduleGPipe(PipelineSchedule):
    """All m forwards, then all m backwards: "fill, then drain"."""

    def order(self) -> list[Action]:
        m = self.n_microbatches  # also there: self.stage.stage_index, self.stage.num_stages
        # TODO: the forwards of microbatches 0 .. m-1, then their backwards, in the same order
        # (the order of the backwards is the order .grad accumulates in: keep it 0 .. m-1 to
        # get one process's bits).
        raise NotImplementedError(
            "TODO exercise 11 (tutorials/exercises/gpipe.py, chapter 14): return "
            f"ScheduleGPipe's order of the {m} forwards and {m} backwards"
        )


# Exercise 11, step 2 (chapter 14b): interleaved 1F1B. Rank r now holds v stages, r, r + W,
# .., and its order names the stage of each action: Action("F", i, stage). Start from 1F1B's
# order above (warm-up forwards, then one forward and one backward in turn, then the backwards
# left) and turn it into interleaved 1F1B's: the k-th forward goes to local stage (k // W) % v,
# the k-th backward to local stage v - 1 - (k // W) % v, and rank r warms up with (v - 1) W +
# 2 (W - 1 - r) forwards (take W | m). Then:
#
#     MINIDDP_PP_INTERLEAVED=tutorials/exercises/gpipe.py:interleaved_order \
#         python -m pytest tests/test_pipeline_interleaved.py -x -q -k yours
#
# replays your orders on the logical clock (refused if they deadlock, or if a rank holds more
# activations than interleaved 1F1B's min(v m, warm-up + 1)), checks the bubble against
# (p - 1) / (v m + p - 1), then trains with them, bit for bit one process.
# (Answer: miniddp/pipeline/interleaved.py.)


def interleaved_order(rank: int, ranks: int, stages_per_rank: int, n_microbatches: int) -> list:
    """Rank `rank`'s interleaved 1F1B order: Action(kind, microbatch, stage) for its stages."""
    raise NotImplementedError(
        "TODO exercise 11, step 2 (tutorials/exercises/gpipe.py, chapter 14b): return "
        f"rank {rank}'s interleaved 1F1B order of {stages_per_rank} stages x "
        f"{n_microbatches} microbatches"
    )
