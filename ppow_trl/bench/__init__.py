"""Benchmark of the evaluation protocol (docs/ppow.md): speculative decoding methods vs the target alone.

    python -m ppow_trl.bench --drafter-layers 2 --num-prompts 8 --max-new-tokens 64 --modes greedy \
        --methods target hf_assisted fast_fixed fast_adaptive --output benchmarks/results/bench_smollm2

Protocol: batch size 1; a warm-up call of every method; then, prompt by prompt, every method back to
back (the order rotates by one each prompt), so that load drift on a shared machine hits all methods
alike. Each ``generate`` call is timed with ``time.perf_counter`` (CUDA synchronised); tokens/s =
generated tokens / seconds; speedup = method tokens/s / target tokens/s *on the same prompt*; the
summary gives the median and p25/p75 over prompts (``ppow_trl.metrics.summarize``, the code of the
``speculative_decoding`` evaluate metric). Greedy outputs are compared token by token with the
target's own greedy output (``lossless``). Sampling (T = 1) is the target's raw distribution (top-k 0,
top-p 1) for every method.

Methods (K = the drafter policy's ``max_window``):
  target         ``target.generate`` alone (the baseline of every speedup).
  hf_assisted    HF assisted generation with the drafter, constant K, ``assistant_confidence_threshold=0``.
  hf_heuristic   HF's "heuristic" schedule (K += 2 after a fully accepted window, else K -= 1), starting at
                 K; as in HF the K it reaches carries over to the next call (reset at the start of a mode).
  hf_confidence  constant K with HF's default ``assistant_confidence_threshold=0.4`` (HF re-tunes it from a
                 ROC curve only when scikit-learn is installed; ``settings.sklearn`` says whether it was).
  prompt_lookup  ``target.generate(prompt_lookup_num_tokens=K)`` (no drafter model).
  hook           our saved drafter through HF's ``assistant_model`` (``ppow_trl.serving.assisted``: our window rule).
DFlash block drafters (``ppow_trl.drafters.dflash``) run ``hf_assisted`` as stock ``speculation_type="dflash"`` (the fixed
block of ``block_size - 1``) and ``hook`` as the same call with our adaptive window; one drafter forward per round.
  fast_fixed     ``ppow_trl.speculative_generate`` with a fixed window (threshold 0).
  fast_adaptive  ``ppow_trl.speculative_generate`` with the drafter's policy (its guard and K = 0 included).
  fast_plain     ``ppow_trl.speculative_generate`` with K = 0 (no drafter): our loop's plain decoding against
                 ``generate``; what a drafter served with K = 0 runs.
The HF variants set the window options on a copy of the drafter's ``generation_config`` (HF reads them
from the assistant's config); the drafter's own config is restored afterwards.

How tau is counted (one convention: tau = generated tokens / target forwards that yield tokens):
  - A forward pre-hook on the target counts every call (``target_forwards``); one on the drafter (and
    on the hook method's loaded copy) counts ``drafter_forwards``.
  - target: HF decodes one token per forward, the first forward covering the prompt, so
    verification forwards = target forwards = tokens and tau = 1.
  - hf_*, prompt_lookup, hook: HF's assisted loop has no separate prefill: its first forward covers the
    prompt plus the first window; every forward is one round yielding A + 1 tokens, so verification
    forwards = target forwards.
  - fast_*: the loop prefills ``prompt[:-1]`` in a forward that yields no token, then runs one forward
    per round: verification forwards = target forwards - 1 = rounds, and tau is the loop's own
    ``SpeculativeOutput.tau`` (the hook count is recorded too and must equal its ``target_forwards``).
"""

# Files, in reading order (this docstring is the CLI's --help and its counting section goes into every report,
# so it stays as it is): runners.py (the methods: one _Runner per method and drafter), timing.py (run_benchmark:
# warm-up, interleaved timed calls, forward counts), report.py (per-method summary, comparisons, Markdown, PNG,
# JSON), cli.py (python -m ppow_trl.bench: arguments, loading models), __main__.py.

from .cli import build_parser, load_bench_prompts, main, parse_args
from .report import (
    COMPARISONS,
    compare,
    format_markdown,
    machine_info,
    plot_histograms,
    summarize_records,
    write_outputs,
)
from .runners import (
    DEFAULT_METHODS,
    DRAFTER_METHODS,
    FAST_METHODS,
    HF_CONFIDENCE_THRESHOLD,
    HF_SCHEDULES,
    METHODS,
    MODES,
    BenchDrafter,
    CallCounter,
)
from .timing import run_benchmark

__all__ = [
    "COMPARISONS",
    "DEFAULT_METHODS",
    "DRAFTER_METHODS",
    "FAST_METHODS",
    "HF_CONFIDENCE_THRESHOLD",
    "HF_SCHEDULES",
    "METHODS",
    "MODES",
    "BenchDrafter",
    "CallCounter",
    "build_parser",
    "compare",
    "format_markdown",
    "load_bench_prompts",
    "machine_info",
    "main",
    "parse_args",
    "plot_histograms",
    "run_benchmark",
    "summarize_records",
    "write_outputs",
]
