"""GPipe and 1F1B: two orders of the same forwards and backwards, and what each one costs.

Every stage runs F i (forward of microbatch i) and B i (its backward) for i = 0 .. m-1. F i on
stage s needs F i on stage s-1; B i on stage s needs B i on stage s+1. With p stages, and each
F taking t_f and each B t_b on every stage:

GPipe (Huang et al., 2019): all forwards, then all backwards ("fill, then drain").

    stage 0   F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
    stage 1   .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .        (B drawn as long as F here)
    stage 2   .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
    stage 3   .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .

  The last stage starts after p-1 forwards and the first ends p-1 backwards after the last
  stage's, so a step lasts (m + p - 1)(t_f + t_b) while each stage computes for m(t_f + t_b):
  the idle share, the *bubble*, is (p - 1) / (m + p - 1). Every stage holds all m microbatches'
  activations when its first backward starts.

1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs min(m, p - s) forwards ("warm-up"),
then alternates one backward and one forward, then runs the backwards left ("cool-down").

    stage 0   F0 F1 F2 F3 .  .  B0 F4 B1 F5 B2 ...
    stage 3   .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 ...

  The same dependencies bound the same makespan, so the bubble is the same (p - 1)/(m + p - 1);
  but a microbatch's activations are freed by its backward as soon as possible, so stage s holds
  at most p - s microbatches at once, however large m is. That is what 1F1B buys: memory, which
  lets m grow, which shrinks the bubble.

With m < p, 1F1B still works: stages whose warm-up covers all m microbatches run GPipe's order,
the later ones alternate as usual (torch's Schedule1F1B refuses m < p; nothing here needs to).
"""

from __future__ import annotations

from miniddp.pipeline.actions import BACKWARD, FORWARD, Action
from miniddp.pipeline.schedule import PipelineSchedule


class ScheduleGPipe(PipelineSchedule):
    """All m forwards, then all m backwards (torch's `ScheduleGPipe`)."""

    def order(self) -> list[Action]:
        m = self.n_microbatches
        return [Action(FORWARD, i) for i in range(m)] + [Action(BACKWARD, i) for i in range(m)]


class Schedule1F1B(PipelineSchedule):
    """Warm-up forwards, then one backward and one forward in turn (torch's `Schedule1F1B`)."""

    def order(self) -> list[Action]:
        m, stage = self.n_microbatches, self.stage
        # Stage s's first backward can start only after microbatch 0 went down the remaining
        # p - s stages: p - s forwards fit before it, and no more are needed to keep it busy.
        warmup = min(m, stage.num_stages - stage.stage_index)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: B i frees what F (i + warmup) takes
            actions += [Action(BACKWARD, i), Action(FORWARD, i + warmup)]
        actions += [Action(BACKWARD, i) for i in range(m - warmup, m)]
        return actions
