"""Chapter 06's figure: the crash, the restart and the resume, on a step axis.

Drawn from chapter 06's own rule with its defaults (20 steps, a checkpoint every 5, the last
rank exiting after step 7 on torchrun's first attempt): attempt 0 trains and checkpoints until
the crash; torchrun stops the survivors and starts attempt 1, which loads the last checkpoint
(step 5) and does steps 6 and 7 again; its step 20 is, bit for bit, the uninterrupted run's.
`schedule` is that rule, so the picture and the chapter's printout cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

STEPS = 20
CHECKPOINT_EVERY = 5
CRASH_AFTER = 7


@dataclass(frozen=True)
class Attempt:
    """One torchrun attempt: the steps it ran (first, last) and the checkpoints it wrote."""

    first: int  # the step it resumed from (0: a fresh start)
    last: int
    checkpoints: tuple[int, ...]
    crashed: bool


def schedule(steps: int, every: int, crash_after: int) -> list[Attempt]:
    """Chapter 06's rule: a checkpoint after every `every`-th step and the last; the crash
    after step `crash_after`, before its checkpoint would be written; the restart resumes from
    the last checkpoint written."""
    written = tuple(s for s in range(every, crash_after) if s % every == 0)
    resumed = written[-1] if written else 0
    later = tuple(s for s in range(resumed + 1, steps + 1) if s % every == 0 or s == steps)
    return [Attempt(0, crash_after, written, True), Attempt(resumed, steps, later, False)]


def failover(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crashed, resumed = schedule(STEPS, CHECKPOINT_EVERY, CRASH_AFTER)
    figure, axes = plt.subplots(figsize=(10, 3.6))
    rows = {"uninterrupted run": 0, "attempt 0": 1, "attempt 1 (restarted)": 2}

    def bar(row: int, first: int, last: int, colour: str, **kw) -> None:
        axes.barh(row, last - first, left=first, height=0.45, color=colour, **kw)

    bar(rows["uninterrupted run"], 0, STEPS, "#bbbbbb")
    bar(rows["attempt 0"], crashed.first, crashed.last, "C0")
    redone = (resumed.first, crashed.last)
    bar(rows["attempt 1 (restarted)"], resumed.first, STEPS, "C2")
    lost = f"steps {redone[0] + 1}-{redone[1]} done again (work lost)"
    bar(rows["attempt 1 (restarted)"], *redone, "C3", label=lost)
    for attempt, row in ((crashed, 1), (resumed, 2)):
        ticks = attempt.checkpoints
        axes.plot(ticks, [row - 0.38] * len(ticks), "v", color="black", markersize=8)
    axes.plot([], [], "v", color="black", label="checkpoint written")
    axes.plot(crashed.last, 1, "X", color="red", markersize=16, markeredgecolor="black")
    note = {"fontsize": 8, "arrowprops": {"arrowstyle": "->"}}
    dying = f"rank 1 (the last) exits after step {crashed.last}\n(os._exit: no cleanup)"
    axes.annotate(dying, (crashed.last, 1), (crashed.last + 1.2, 0.72), **note)
    restart = f"torchrun restarts every rank;\nload_checkpoint (step {resumed.first})"
    axes.annotate(restart, (resumed.first, 2), (0.2, 1.68), **note)
    same = f"step {STEPS}: the same bits"
    for row in (0.25, 1.75):
        axes.annotate(same if row < 1 else "", (STEPS, row), (STEPS - 5.5, 1.05), **note)
    axes.set_yticks(list(rows.values()), list(rows))
    axes.set_ylim(2.45, -0.55)
    axes.set_xlim(-0.5, STEPS + 0.5)
    axes.set_xticks(range(0, STEPS + 1, 1))
    axes.set_xlabel("optimizer step")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8)
    axes.set_title(
        f"Failover (chapter 06): a checkpoint every {CHECKPOINT_EVERY} steps, a crash after step "
        f"{CRASH_AFTER}, a restart that resumes from step {resumed.first}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(figure)
    return path
