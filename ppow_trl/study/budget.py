"""Training to a wall-clock budget, with probes of the drafter along the way (the study's equal-budget rule)."""

from __future__ import annotations

import time
from collections.abc import Callable

from transformers import TrainerCallback


class TrainingBudget(TrainerCallback):
    """Stop training after ``seconds`` of optimizer-step time; probe the drafter every ``probe_every`` seconds.

    Step time is measured from ``on_step_begin`` to ``on_step_end``: rollouts, target verification, loss,
    backward and optimizer (everything a training step costs), but not logging, checkpointing or the probes
    themselves, so an arm that is probed more often is not charged for it. ``probe(model) -> dict`` runs at
    the start (0 s) and each time the step time crosses a multiple of ``probe_every``; ``milestones`` maps a
    step time to a callback ``fn(model)`` run once when it is first crossed (e.g. saving the warm start that
    other arms continue from). ``history`` holds ``{"train_seconds", "step", **probe(model)}`` rows.
    """

    def __init__(self, seconds: float, *, probe: Callable | None = None, probe_every: float | None = None,
                 milestones: dict[float, Callable] | None = None):
        if not seconds > 0:
            raise ValueError(f"The training budget must be > 0 seconds, got {seconds}.")
        self.seconds = float(seconds)
        self.probe, self.probe_every = probe, probe_every
        self.milestones = dict(sorted((milestones or {}).items()))
        self.elapsed = 0.0
        self.history: list[dict] = []
        self._started: float | None = None
        self._next_probe = probe_every or float("inf")

    def _record(self, model, step: int) -> None:
        if self.probe is not None:
            self.history.append({"train_seconds": round(self.elapsed, 2), "step": step, **self.probe(model)})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not self.history:
            self._record(model, state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._started = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._started is not None:
            self.elapsed += time.perf_counter() - self._started
            self._started = None
        for when in [w for w in self.milestones if self.elapsed >= w]:
            self.milestones.pop(when)(model)
        if self.elapsed >= self.seconds:
            control.should_training_stop = True
            self._record(model, state.global_step)
        elif self.elapsed >= self._next_probe:
            self._record(model, state.global_step)
            while self._next_probe <= self.elapsed:
                self._next_probe += self.probe_every
        return control
