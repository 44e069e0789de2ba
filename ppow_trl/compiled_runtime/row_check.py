"""Which compiled graphs a verifier may run so that speculative decoding stays lossless on this machine.

Lossless greedy speculation needs every row of an ``L``-row verify call bitwise equal to the one-token step's row at
that position. The row-independent settings give that where inductor runs one kernel for every row count, but it
chooses kernels per shape: on a CPU with AMX, its int8 weight-only GEMM takes the AMX micro-kernel from 5 rows on and
an AVX-512 one below (``skip_amx_kernel_for_woq`` in ``torch/_inductor/codegen/cpp_micro_gemm.py``), and SmolLM2 int8
at K = 4 then equalled plain decoding on 4 of 16 prompts. So after the warm-up the graphs are checked bitwise
(``differing_row_counts``), and where some row count differs, one of two plans is served:

- **split** (``RowPlan.graphs``): a call of a row count that differs is scored in consecutive chunks, each on a graph
  that agrees (``split_rows``, largest first; the 1-row graph always agrees). Plain decoding keeps its own graph and
  costs nothing more; a verify of ``L`` rows costs the chunks' sum, which the cost model measures, so the served rule
  drafts long windows only where they still pay.
- **uniform** (``RowPlan.uniform``): every call runs the ``max_rows`` graph (padding rows, cropped back): full windows
  at that graph's cost, which plain decoding then pays on every step too.

``choose_row_plan`` serves uniform only where the ``max_rows`` graph's one-token step is measured no slower than the
decode step's own graph, so that the fix never costs plain decoding (uniform padding cost 16% per plain step on the
AMX Xeon's int8 target: t(5 rows)/t(1 row) = 1.15-1.16).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowPlan:
    """The graphs calls run. ``graphs``: the row counts a call may run as one graph (a call of another count is split
    into chunks of these); ``uniform``: every call runs the largest graph instead. The default serves every row
    count on its own graph."""

    graphs: tuple[int, ...] | None = None
    uniform: bool = False

    def describe(self, max_rows: int) -> str:
        """A label suffix: how calls run, when not each on its own graph."""
        if self.uniform:
            return f", every call on the {max_rows}-row graph"
        if self.graphs is not None:
            split = [rows for rows in range(2, max_rows + 1) if rows not in self.graphs]
            return f", {'/'.join(map(str, split))}-row calls split over the {'/'.join(map(str, self.graphs))}-row graphs"
        return ""


def split_rows(rows: int, graphs: tuple[int, ...]) -> list[int]:
    """``rows`` as consecutive chunks, each a count in ``graphs`` (which holds 1): largest first, so the fewest calls.
    ``split_rows(5, (1, 2, 4)) == [4, 1]``."""
    chunks = []
    while rows:
        chunk = max(count for count in graphs if count <= rows)
        chunks.append(chunk)
        rows -= chunk
    return chunks


def differing_row_counts(runtime, context: int = 24, seed: int = 0) -> list[int]:
    """Row counts ``L`` (2..``max_rows``) whose call, as ``runtime``'s forward serves it, scores some position
    differently (in any bit) from one-token steps over the same cache: a seeded random context, then ``max_rows``
    positions each way. The context shrinks to fit a small cache; a cache too small for any is an error."""
    max_rows = runtime.max_rows
    context = min(context, runtime.max_cache_len - 2 * max_rows)
    if context < 1:
        raise ValueError(f"max_cache_len={runtime.max_cache_len} leaves no room to check the {max_rows}-row graphs "
                         f"against decode steps: use max_cache_len >= {2 * max_rows + 1}.")
    vocab = int(getattr(runtime.model.config, "vocab_size", 2))
    ids = torch.randint(0, vocab, (1, context + max_rows), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(runtime.model.device)
    cache = runtime.new_cache()
    with torch.no_grad():
        runtime.model(input_ids=ids[:, :context], cache=cache, use_cache=True)
        steps = [runtime(input_ids=ids[:, i:i + 1], cache=cache).logits[0, -1] for i in range(context, ids.shape[1])]
        cache.crop(-max_rows)
        differing = []
        for rows in range(2, max_rows + 1):
            logits = runtime(input_ids=ids[:, context:context + rows], cache=cache).logits[0]
            if any(not torch.equal(logits[r], steps[r]) for r in range(rows)):
                differing.append(rows)
            cache.crop(-rows)
    runtime.new_cache()
    return differing


def choose_row_plan(runtime, step_seconds) -> RowPlan:
    """The plan ``runtime`` (a warm ``CompiledCausalLM``) serves: its own graphs where every row count agrees with the
    decode step, else uniform or split (module docstring), checked again once chosen. ``step_seconds(graphs)`` gives
    the median seconds of a one-token step on each graph of ``graphs`` (padding rows), timed side by side."""
    differing = differing_row_counts(runtime)
    if not differing:
        return RowPlan()
    name, max_rows = type(runtime.model).__name__, runtime.max_rows
    agreeing = tuple(rows for rows in range(1, max_rows + 1) if rows not in differing)
    plans = [RowPlan(graphs=agreeing)]
    # Uniform compares the largest graph with itself (decode steps run it too), so it holds whichever graph differs;
    # it is served only where it costs plain decoding nothing.
    decode = runtime._graph_rows(1)
    seconds = step_seconds([decode, max_rows])
    logger.info("One-token step: %.1f ms as decoding runs it, %.1f ms on the %d-row graph", seconds[decode] * 1e3,
                seconds[max_rows] * 1e3, max_rows)
    if seconds[max_rows] <= seconds[decode]:
        plans.insert(0, RowPlan(uniform=True))
    for plan in plans + [RowPlan(graphs=(1,))]:
        runtime.row_plan = plan
        still = differing_row_counts(runtime)
        if not still:
            break
    logger.warning("On this machine the compiled %s-row graph%s of %s computed rows that differ in their last bits from "
                   "the one-token step's (inductor chose other kernels for that shape); so that speculative decoding "
                   "stays lossless, %s%s.", "/".join(map(str, differing)), "s" if len(differing) > 1 else "", name,
                   _plan_words(runtime.row_plan, max_rows),
                   "" if not still else f" (rows still differ for {still}: serve K = 0 here)")
    return runtime.row_plan


def _plan_words(plan: RowPlan, max_rows: int) -> str:
    if plan.uniform:
        return f"every call now runs the {max_rows}-row graph"
    if plan.graphs == (1,):
        return "every call is now scored one row at a time (speculation cannot pay: the served rule will draft nothing)"
    return f"calls of those row counts are now split over the {'/'.join(map(str, plan.graphs))}-row graphs"
