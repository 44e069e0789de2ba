"""tau and speedup of speculative decoding over prompts: the one implementation (numpy only).

Used by the `speculative_decoding` evaluate metric (the script next to this file, which evaluate copies
together with this module) and by `python -m ppow_trl.bench` (through `ppow_trl.metrics`), so both
compute every number the same way. Conventions: see `TAU_CONVENTION` and `SPEEDUP_CONVENTION`.
"""

import numpy as np

TAU_CONVENTION = (
    "tau = sum(tokens generated) / sum(target verification forwards): bonus/correction token included, a "
    "separate prefill forward (one that yields no token) excluded; pooled over prompts"
)
SPEEDUP_CONVENTION = (
    "speedup = median over prompts of (tokens/s of the method) / (tokens/s of the target alone on the same prompt), "
    "with p25/p75"
)


def _spread(values) -> dict:
    """``median``, ``p25`` and ``p75`` of ``values`` (numpy's linear interpolation); NaN when empty."""
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {"median": float("nan"), "p25": float("nan"), "p75": float("nan")}
    p25, median, p75 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "p25": float(p25), "p75": float(p75)}


def summarize(generated_tokens, target_forwards, seconds, baseline_tokens=None, baseline_seconds=None) -> dict:
    """tau and speedup of one method over prompts (``TAU_CONVENTION``, ``SPEEDUP_CONVENTION``; details in the
    docstring of the ``speculative_decoding`` metric script next to this file).

    Every argument is a sequence with one entry per prompt; without a baseline the ``speedup_*``
    entries are None. Raises ValueError on mismatched lengths, non-positive seconds or negative counts.
    """
    tokens = np.asarray(generated_tokens, dtype=np.float64)
    forwards = np.asarray(target_forwards, dtype=np.float64)
    secs = np.asarray(seconds, dtype=np.float64)
    columns = {"target_forwards": forwards, "seconds": secs}
    has_baseline = baseline_tokens is not None or baseline_seconds is not None
    if has_baseline:
        if baseline_tokens is None or baseline_seconds is None:
            raise ValueError("Pass both baseline_tokens and baseline_seconds, or neither.")
        base_tokens = np.asarray(baseline_tokens, dtype=np.float64)
        base_secs = np.asarray(baseline_seconds, dtype=np.float64)
        columns.update(baseline_tokens=base_tokens, baseline_seconds=base_secs)
    for name, column in columns.items():
        if column.shape != tokens.shape:
            raise ValueError(
                f"{name} has {column.size} entries but generated_tokens has {tokens.size}: one per prompt."
            )
    if (tokens < 0).any() or (forwards < 0).any():
        raise ValueError("generated_tokens and target_forwards must be >= 0.")
    if (secs <= 0).any() or (has_baseline and (base_secs <= 0).any()):
        raise ValueError("seconds and baseline_seconds must be > 0 (a wall-clock time per prompt).")

    total_forwards = forwards.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        per_prompt_tau = np.where(forwards > 0, tokens / np.maximum(forwards, 1), np.nan)
    speed = tokens / secs
    result = {
        "num_prompts": int(tokens.size),
        "tokens": int(tokens.sum()),
        "tau": float(tokens.sum() / total_forwards) if total_forwards > 0 else float("nan"),
        "tau_mean": float(np.nanmean(per_prompt_tau)) if np.isfinite(per_prompt_tau).any() else float("nan"),
    }
    result.update({f"tokens_per_second_{k}": v for k, v in _spread(speed).items()})
    if has_baseline:
        speedups = speed / (base_tokens / base_secs)
        result.update({f"speedup_{k}": v for k, v in _spread(speedups).items()})
    else:
        result.update(speedup_median=None, speedup_p25=None, speedup_p75=None)
    result.update(tau_convention=TAU_CONVENTION, speedup_convention=SPEEDUP_CONVENTION)
    return result
