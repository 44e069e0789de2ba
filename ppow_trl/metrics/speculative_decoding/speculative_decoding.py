"""speculative_decoding: tau and speedup of a speculative decoding run, from per-prompt records.

An `evaluate` metric script: load it with `evaluate.load(<this folder>)` or
`ppow_trl.metrics.load_speculative_metric()` (no Hub access needed). The numbers come from
`summary.summarize` next to it (numpy only; evaluate copies it along with this script), which
`python -m ppow_trl.bench` uses too, so the metric and the benchmark compute every number one way.

Conventions (ppow_trl docs/ppow.md, "Evaluation protocol"):

- ``tau = sum(generated_tokens) / sum(target_forwards)`` over all prompts (a ratio of sums, i.e.
  tokens per verification forward pooled over the run), where ``target_forwards`` counts the target
  forward passes that verify/produce tokens: the bonus/correction token is included in the tokens,
  a separate prefill forward that yields no token is excluded (EAGLE's convention). Plain decoding
  has ``tau = 1``. ``tau_mean`` is the unweighted mean of per-prompt taus, for reference.
- ``speedup`` per prompt = (generated_tokens / seconds) / (baseline_tokens / baseline_seconds), the
  baseline (the target alone) timed on the same prompt in the same run; reported as the median over
  prompts with the 25th and 75th percentiles (numpy's default linear interpolation).
"""

import datasets
import evaluate

from .summary import SPEEDUP_CONVENTION, TAU_CONVENTION, summarize

_DESCRIPTION = __doc__
_CITATION = """\
@misc{ppow_trl,
  title = {ppow_trl: PPOW speculative-decoding drafters for TRL},
  note = {Evaluation protocol: tau in EAGLE's convention (Li et al., 2024, arXiv 2401.15077)}
}
"""
_KWARGS_DESCRIPTION = """
Args (one entry per prompt):
    generated_tokens (`list[int]`): tokens the method generated.
    target_forwards (`list[int]`): target forward passes that verified/produced those tokens (a separate
        prefill forward excluded; see the module docstring).
    seconds (`list[float]`): wall-clock seconds of the method's generation call.
    baseline_tokens (`list[int]`): tokens the target alone generated on the same prompt.
    baseline_seconds (`list[float]`): its wall-clock seconds.
Returns:
    num_prompts, tokens, tau, tau_mean, tokens_per_second_{median,p25,p75}, speedup_{median,p25,p75},
    tau_convention, speedup_convention.
Example:
    >>> metric = evaluate.load("ppow_trl/metrics/speculative_decoding")
    >>> metric.compute(generated_tokens=[64, 60], target_forwards=[32, 40], seconds=[2.0, 2.5],
    ...                baseline_tokens=[64, 60], baseline_seconds=[4.0, 3.0])["tau"]
    1.722...
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class SpeculativeDecoding(evaluate.Metric):
    """tau (tokens per verification forward) and speedup over the target alone, from per-prompt records."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "generated_tokens": datasets.Value("int64"),
                    "target_forwards": datasets.Value("int64"),
                    "seconds": datasets.Value("float64"),
                    "baseline_tokens": datasets.Value("int64"),
                    "baseline_seconds": datasets.Value("float64"),
                }
            ),
            reference_urls=["https://arxiv.org/abs/2401.15077"],
        )

    def _compute(self, generated_tokens, target_forwards, seconds, baseline_tokens, baseline_seconds):
        return summarize(generated_tokens, target_forwards, seconds, baseline_tokens, baseline_seconds)
