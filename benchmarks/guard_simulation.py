"""The online guard on simulated rounds: what it keeps of a rule that pays, what it saves on one that stopped paying.

Rounds are drawn, not decoded, so that thousands of generations take seconds and the guard is judged apart from
timing noise. A rule ``K`` drafts ``K`` tokens every round (``h = 0``); the accepted length follows per-token
acceptance ``alpha`` (``P(A >= k) = alpha^k``, ``k <= K``). A drafting round costs the rule's break-even
``b = K t_d + t_v(K)`` target steps, from the compiled-runtime cost model of the data-scaling curve's 100k point
(AMD EPYC, fp32: ``t_d = 0.148``, ``t_v(1..4) = 0.97 / 1.13 / 1.40 / 1.55``); a plain round costs 1 step and yields
1 token. A generation runs until 128 tokens (and 1,024), through the real ``SpeculationGuard`` and its protocol
(``decide()`` each round, ``record(A)`` of the previous drafting round when the next one starts).

For each ``K``: a calibrated ``alpha`` at which the rule pays, a collapsed ``alpha = 0.02`` (a drafter out of its
domain) that keeps the calibrated guard (its ``b`` and its loss budget from the paying rule's spread), and bursty
cases. The loss budget assumes rounds independent (``sigma_A`` of one round); real text comes in stretches that are
easy or hard to draft. In the bursty cases acceptance switches between ``alpha (1 + d)`` and ``alpha (1 - d)``
(``d`` in ``BURST_DEPTHS``, half the text each in the long run), leaving its stretch with probability ``1 / BURST_TOKENS``
per token, so hard stretches where the rule loses last ``BURST_TOKENS`` tokens on average; the guard keeps the
independent-round budget, and its speedup is compared with the unguarded rule's on the same stretches. Arms:
``unguarded``, ``windowed`` (the guard this replaced: pause 32 rounds when 8 rounds averaged under ``0.95 b``, a
single probe round decides), the loss-budget guard at several budgets ``c sigma_A``, fresh in every generation, and
the served default (``5 sigma``) with its evidence carried across the arm's generations (``across_generations``). Reported: speedup over plain
decoding (tokens / steps, mean over generations) and the fraction of rounds that drafted.

    python benchmarks/guard_simulation.py     # ~2 min, writes benchmarks/results/guard_simulation.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from ppow_trl.serving.calibration import guard_loss_budget
from ppow_trl.core.custom_generate.generate import SpeculationGuard
from ppow_trl.core.windowing import accepted_spread_within

DRAFTER_COST = 0.148
VERIFY_COST = {1: 0.97, 2: 1.13, 3: 1.40, 4: 1.55}
PAYING_ALPHA = {1: 0.19, 2: 0.45, 3: 0.6, 4: 0.7}
COLLAPSED_ALPHA = 0.02
BURST_DEPTHS = (0.3, 0.8)  # hard stretches that still pay for K = 1 / that lose for every K
BURST_TOKENS = 48
SPREADS = (2.0, 3.0, 5.0, 8.0)


class WindowedGuard:
    """The guard before the loss budget, for comparison: pause ``probe_every`` rounds when the last ``window`` rounds
    yielded under ``(1 - margin) b`` tokens each on average; the first drafting round after a pause decides alone."""

    def __init__(self, b, window=8, probe_every=32, margin=0.05):
        self.line, self.window, self.probe_every = (1 - margin) * b, window, probe_every
        self.history, self.paused_left, self.probing, self.ignore_next = [], 0, False, False

    def decide(self):
        if self.paused_left > 0:
            self.paused_left -= 1
            return False
        return True

    def record(self, accepted):
        if self.ignore_next:
            self.ignore_next = False
            return
        tokens = accepted + 1
        if self.probing:
            self.probing = False
            if tokens >= self.line:
                self.history = [tokens]
            else:
                self._pause()
            return
        self.history = (self.history + [tokens])[-self.window:]
        if len(self.history) == self.window and sum(self.history) < self.line * self.window:
            self._pause()

    def _pause(self):
        self.history, self.paused_left, self.probing, self.ignore_next = [], self.probe_every, True, True


def accepted(rng, alpha, max_window):
    count = 0
    while count < max_window and rng.random() < alpha:
        count += 1
    return count


class Bursty:
    """Per-token acceptance that switches between ``alpha (1 + d)`` (capped at 0.95) and ``alpha (1 - d)``: the text
    leaves its stretch with probability ``1 / tokens`` at each token, and starts in either stretch at random. The
    stretches are drawn from their own stream, so every arm of a comparison meets the same text."""

    def __init__(self, seed, alpha, depth, tokens=BURST_TOKENS):
        self.rng, self.levels, self.leave = random.Random(seed), (min(0.95, alpha * (1 + depth)), alpha * (1 - depth)), 1 / tokens
        self.states = [self.rng.random() < 0.5]

    def at(self, position):
        """The acceptance of the round that starts at token ``position``."""
        while len(self.states) <= position:
            self.states.append(self.states[-1] != (self.rng.random() < self.leave))
        return self.levels[self.states[position]]


def spread(alpha, max_window):
    """Standard deviation of ``A`` when ``P(A >= k) = alpha^k`` (the calibration's ``accepted_spread_within``)."""
    prefix = torch.tensor([[alpha**k for k in range(1, max_window + 1)]], dtype=torch.float64)
    return accepted_spread_within(prefix, torch.tensor([max_window]))


def generation(rng, guard, alpha, max_window, b, new_tokens, text=None):
    """Tokens / target steps of one generation, and the fraction of rounds that drafted. ``text``: a ``Bursty``
    process that sets the acceptance of each round from the token it starts at (``None``: ``alpha`` throughout)."""
    tokens = steps = rounds = drafting = 0
    previous = None
    while tokens < new_tokens:
        rounds += 1
        alpha_now = alpha if text is None else text.at(tokens)
        if guard is None or guard.decide():
            if guard is not None and previous is not None:
                guard.record(previous)
            previous = accepted(rng, alpha_now, max_window)
            tokens, steps, drafting = tokens + previous + 1, steps + b, drafting + 1
        else:
            tokens, steps = tokens + 1, steps + 1
    return tokens / steps, drafting / rounds


def arm(make_guard, alpha, max_window, b, generations, new_tokens, seed, depth=None):
    rng = random.Random(seed)
    speeds, fractions = zip(*(generation(rng, make_guard(), alpha, max_window, b, new_tokens,
                                         Bursty(f"{seed}-{index}", alpha, depth) if depth else None)
                              for index in range(generations)))
    return {"speedup": sum(speeds) / len(speeds), "drafting_fraction": sum(fractions) / len(fractions)}


class Carried:
    """One guard for every generation of an arm (``across_generations``: the served default), started afresh per
    arm: each call begins a generation on it (``SpeculationGuard.new_generation``)."""

    def __init__(self, b, budget):
        self.b, self.budget, self.guard = b, budget, None

    def __call__(self):
        if self.guard is None:
            self.guard = SpeculationGuard(self.b, self.budget, across_generations=True)
        self.guard.new_generation()
        return self.guard

    def fresh(self):
        return Carried(self.b, self.budget)


def rules_at(new_tokens: int, generations: int) -> list[dict]:
    """Every rule's arms (paying and collapsed) over generations of ``new_tokens`` tokens."""
    rules = []
    for max_window, alpha in PAYING_ALPHA.items():
        b = max_window * DRAFTER_COST + VERIFY_COST[max_window]
        sigma = spread(alpha, max_window)
        row = {"max_window": max_window, "break_even_tokens": b, "spread": sigma, "paying_alpha": alpha,
               "collapsed_alpha": COLLAPSED_ALPHA,
               "bursty_alphas": {f"bursty_{d:g}": [min(0.95, alpha * (1 + d)), alpha * (1 - d)] for d in BURST_DEPTHS},
               "arms": {}}
        arms = {"unguarded": lambda: None, "windowed": lambda b=b: WindowedGuard(b)}
        arms.update({f"loss_budget[{c:g} sigma]": (lambda h=guard_loss_budget(b, sigma, c), b=b: SpeculationGuard(b, h))
                     for c in SPREADS})
        # the served default: 5 sigma, the guard's evidence carried from one generation to the next
        arms["loss_budget[5 sigma], across generations"] = Carried(b, guard_loss_budget(b, sigma, 5.0))
        for name, make_guard in arms.items():
            cases = [("paying", alpha, None), ("collapsed", COLLAPSED_ALPHA, None)]
            cases += [(f"bursty_{d:g}", alpha, d) for d in BURST_DEPTHS]
            row["arms"][name] = {case: arm(make_guard.fresh() if isinstance(make_guard, Carried) else make_guard, a,
                                           max_window, b, generations, new_tokens, seed, depth)
                                 for seed, (case, a, depth) in enumerate(cases)}
        rules.append(row)
        print(f"{new_tokens} tokens, K = {max_window}, b = {b:.3f}, sigma_A = {sigma:.2f}: " + "; ".join(
            f"{name} " + " / ".join(f"{case['speedup']:.3f}" for case in r.values()) for name, r in row["arms"].items()))
    return rules


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generations", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 1024],
                        help="tokens per generation (long generations meet more runs of misses)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "guard_simulation.json")
    args = parser.parse_args(argv)
    by_length = {str(n): rules_at(n, args.generations) for n in args.new_tokens}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python benchmarks/guard_simulation.py", "generations": args.generations,
        "drafter_cost": DRAFTER_COST, "verify_cost": VERIFY_COST, "burst_depths": BURST_DEPTHS,
        "burst_tokens": BURST_TOKENS,
        "note": "simulated rounds; speedup = tokens / target steps over plain decoding, mean over generations; "
                "each arm: paying, collapsed and bursty acceptance (bursty_<d>: stretches at alpha (1 +- d))", "rules_by_new_tokens": by_length}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
