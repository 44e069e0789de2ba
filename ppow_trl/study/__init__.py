"""The study: PPOW vs token-level distillation at equal budget, with ablations and bootstrap intervals.

``python benchmarks/study.py`` (= ``python -m ppow_trl.study``) runs it; see ``runner``.
"""

from .arms import ARMS, Arm
from .budget import TrainingBudget
from .evaluate import bootstrap_interval, greedy_records, paired_ratio_interval, sampled_records, summarize

__all__ = ["ARMS", "Arm", "TrainingBudget", "bootstrap_interval", "greedy_records", "paired_ratio_interval",
           "sampled_records", "summarize"]
