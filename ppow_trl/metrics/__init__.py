"""Metrics of the evaluation protocol as `evaluate` modules that load offline.

``summarize`` (tau and speedup, median/p25/p75; numpy only) is the code the ``speculative_decoding`` metric
script runs, so the metric and ``python -m ppow_trl.bench`` compute every number one way. Importing this
package needs neither evaluate nor datasets; ``load_speculative_metric`` needs evaluate.
"""

from __future__ import annotations

from pathlib import Path

from .speculative_decoding.summary import SPEEDUP_CONVENTION, TAU_CONVENTION, summarize

SPECULATIVE_METRIC_PATH = Path(__file__).resolve().parent / "speculative_decoding"


def load_speculative_metric(**kwargs):
    """``evaluate.load`` of the local ``speculative_decoding`` metric script (no Hub access needed).

    ``kwargs`` go to ``evaluate.load`` (e.g. ``experiment_id``, ``keep_in_memory=True``).
    """
    import evaluate

    return evaluate.load(str(SPECULATIVE_METRIC_PATH), **kwargs)


__all__ = ["SPECULATIVE_METRIC_PATH", "SPEEDUP_CONVENTION", "TAU_CONVENTION", "load_speculative_metric", "summarize"]
