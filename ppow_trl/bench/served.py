"""Served configurations side by side: plain and speculative decoding on each runtime, and transformers' ``generate``.

``serving_arms(...)`` builds the rows a user can choose between: ``hf_generate_eager`` (transformers' ``generate``,
dynamic cache, eager), ``compiled_plain[<precision>]`` / ``eager_plain`` (ppow_trl's loop without a drafter on the
serving runtime) and ``compiled_speculative[<name>]`` / ``eager_speculative[<name>]`` (the loop with a drafter and its
served rule). ``compare_arms`` runs every arm on every prompt, back to back in an order that rotates by one each
prompt (a burst of load on a shared machine lands on all arms alike), and summarises each arm:

- ``ms_per_token``: median over prompts of seconds / new tokens, with a 95% bootstrap interval;
- ``speedup_vs_<baseline>``: the ratio of throughputs over all prompts, ``(sum_p n_arm(p) / sum_p t_arm(p)) /
  (sum_p n_baseline(p) / sum_p t_baseline(p))`` (new tokens per second; when both arms generate the same tokens, the
  ratio of total times), with a 95% bootstrap interval over prompts;
- ``tau``: new tokens per verification forward (``ppow_trl.metrics``);
- ``lossless_prompts``: prompts whose tokens equal the reference arm's (the plain arm of the same runtime and
  precision), as ``"k/n"``; ``agrees_with_eager_prompts``: the same against eager plain decoding (the kernels differ
  between runtimes, so a near tie may flip a token).

A long comparison (a benchmark of hours) passes ``checkpoint=``: a JSON-lines file that gets one line per finished
prompt (every arm's tokens and seconds). Run again with the same file, it reads those prompts back and runs only the
rest, so a run that is killed loses at most the prompt it was on.
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..serving.generation import speculative_generate
from ..core.windowing import AdaptiveWindowPolicy


@dataclass
class Arm:
    """One served configuration: ``run(prompt_ids (1, T), max_new_tokens) -> (new tokens, target forwards that
    verified)``; ``reference``: the label of the arm whose tokens it must reproduce (itself for a plain arm)."""

    label: str
    run: Callable
    reference: str
    info: dict = field(default_factory=dict)


def loop_arm(label: str, target, drafter, policy: AdaptiveWindowPolicy, stop_ids, vocab_size: int, reference: str,
             info: dict | None = None) -> Arm:
    """ppow_trl's own loop (``speculative_generate``, greedy) with ``drafter`` under ``policy`` (K = 0: plain)."""

    def run(ids, max_new_tokens):
        out = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=max_new_tokens,
                                   eos_token_id=stop_ids, vocab_size=vocab_size)
        return out.new_tokens, out.target_forwards - out.prefill_forwards

    return Arm(label, run, reference, info or {})


def generate_arm(label: str, target, stop_ids, pad_id: int, reference: str, info: dict | None = None,
                 **generate_kwargs) -> Arm:
    """transformers' ``target.generate`` (greedy, raw argmax: no repetition penalty), with ``generate_kwargs``."""

    def run(ids, max_new_tokens):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, repetition_penalty=1.0, no_repeat_ngram_size=0,
                              eos_token_id=stop_ids, pad_token_id=pad_id, **generate_kwargs)
        tokens = out[0, ids.shape[1]:].tolist()
        return tokens, len(tokens)

    return Arm(label, run, reference, info or {})


def _bootstrap(values_by_prompt: list, statistic: Callable, seed: int = 0, draws: int = 2000) -> tuple[float, float]:
    """95% percentile interval of ``statistic`` over prompts resampled with replacement."""
    rng = random.Random(seed)
    n = len(values_by_prompt)
    results = sorted(statistic([values_by_prompt[rng.randrange(n)] for _ in range(n)]) for _ in range(draws))
    return results[int(0.025 * draws)], results[int(0.975 * draws) - 1]


def _same_tokens(tokens, reference) -> bool:
    return list(tokens) == list(reference)


@torch.no_grad()
def _prompt_digest(ids: torch.Tensor) -> str:
    return hashlib.sha1(json.dumps(ids.flatten().tolist()).encode()).hexdigest()[:16]


def _read_checkpoint(path: Path, labels: list[str], max_new_tokens: int, digests: list[str]) -> dict[int, dict]:
    """The finished prompts of an earlier run, ``{prompt index: row}``, after checking that it ran these arms on these
    prompts; a truncated last line (a run killed while writing) is dropped."""
    lines = path.read_text().splitlines()
    if not lines:
        return {}
    header = json.loads(lines[0])
    if header != {"labels": labels, "max_new_tokens": max_new_tokens}:
        raise ValueError(f"The checkpoint {path} was written by another comparison ({header}), not this one "
                         f"(arms {labels}, max_new_tokens {max_new_tokens}): delete it to start over.")
    done = {}
    for number, line in enumerate(lines[1:], start=2):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the line a killed run was writing
                break
            raise ValueError(f"The checkpoint {path} is damaged at line {number}: delete it to start over.") from None
        index = entry["index"]
        if index >= len(digests) or entry["prompt"] != digests[index]:
            raise ValueError(f"The checkpoint {path} holds prompt {index} of another prompt list: delete it to start "
                             "over.")
        done[index] = entry["row"]
    return done


def compare_arms(arms: list[Arm], prompt_ids: list[torch.Tensor], *, max_new_tokens: int, baselines: list[str],
                 eager_reference: str | None = None, warmup: bool = True, progress: bool = True,
                 checkpoint: str | Path | None = None) -> dict:
    """Every arm on every prompt, rotated; returns ``{"arms": {label: summary}, "records": [...]}`` (module doc).
    With ``checkpoint``, the prompts already in that file are read back, not run again."""
    from tqdm.auto import tqdm

    labels = [arm.label for arm in arms]
    if not prompt_ids:
        raise ValueError("compare_arms needs at least one prompt.")
    missing = [name for name in baselines + [arm.reference for arm in arms] + [eager_reference or labels[0]]
               if name not in labels]
    if missing:
        raise ValueError(f"compare_arms: baseline or reference arms {missing} are not among the arms {labels}.")
    digests = [_prompt_digest(ids) for ids in prompt_ids]
    done = {}
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        if checkpoint.is_file():
            done = _read_checkpoint(checkpoint, labels, max_new_tokens, digests)
        # Written again from what was read: a line a killed run left half-written must not prefix the next one.
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.write_text("".join(json.dumps(entry) + "\n" for entry in
                                      [{"labels": labels, "max_new_tokens": max_new_tokens}] +
                                      [{"index": i, "prompt": digests[i], "row": row} for i, row in sorted(done.items())]))
    if warmup and len(done) < len(prompt_ids):  # first calls (allocations, lazy imports) are not timed
        for arm in arms:
            arm.run(prompt_ids[0], 4)
    records = []
    for index, ids in enumerate(tqdm(prompt_ids, desc="Prompts (every arm)", disable=not progress)):
        if index in done:
            records.append(done[index])
            continue
        order = arms[index % len(arms):] + arms[: index % len(arms)]
        row = {}
        for arm in order:
            start = time.perf_counter()
            tokens, verify_forwards = arm.run(ids, max_new_tokens)
            seconds = time.perf_counter() - start
            row[arm.label] = {"tokens": [int(t) for t in tokens], "seconds": seconds,
                              "verify_forwards": int(verify_forwards)}
        records.append(row)
        if checkpoint is not None:
            with checkpoint.open("a") as handle:
                handle.write(json.dumps({"index": index, "prompt": digests[index], "row": row}) + "\n")
    return {"arms": summarize_records(arms, records, baselines=baselines, eager_reference=eager_reference or labels[0]),
            "records": [{label: {k: v for k, v in cell.items() if k != "tokens"} for label, cell in row.items()}
                        for row in records]}


def _throughput_ratio(records: list[dict], label: str, baseline: str) -> tuple[float, tuple[float, float]]:
    """``label``'s throughput over ``baseline``'s over all prompts (module doc), with its 95% bootstrap interval."""
    pairs = [(r[baseline]["seconds"], max(1, len(r[baseline]["tokens"])), r[label]["seconds"],
              max(1, len(r[label]["tokens"]))) for r in records]

    def ratio(sample):  # throughput of the arm over the baseline's, over the sampled prompts
        return (sum(n for _, _, _, n in sample) / sum(t for _, _, t, _ in sample)) / (
            sum(n for _, n, _, _ in sample) / sum(t for t, _, _, _ in sample))

    return ratio(pairs), _bootstrap(pairs, ratio)


def summarize_records(arms: list[Arm], records: list[dict], *, baselines: list[str], eager_reference: str) -> dict:
    """Each arm's summary (module doc) from ``records``, one ``{label: {"tokens", "seconds", "verify_forwards"}}``
    per prompt. Besides the speedups against ``baselines``, ``speedup_vs_reference``: against the arm's own reference,
    the plain arm of its runtime and precision (an int8 speculative row against int8 plain decoding)."""
    summary = {}
    for arm in arms:
        per_prompt = [r[arm.label] for r in records]
        ms = [1000 * p["seconds"] / max(1, len(p["tokens"])) for p in per_prompt]
        entry = {
            **arm.info,
            "prompts": len(per_prompt),
            "ms_per_token_median": statistics.median(ms),
            "ms_per_token_ci95": _bootstrap(ms, statistics.median),
            "tau": sum(len(p["tokens"]) for p in per_prompt) / max(1, sum(p["verify_forwards"] for p in per_prompt)),
            "lossless_prompts": "reference" if arm.reference == arm.label else
            f"{sum(_same_tokens(r[arm.label]['tokens'], r[arm.reference]['tokens']) for r in records)}/{len(records)}",
            "agrees_with_eager_prompts": f"{sum(_same_tokens(r[arm.label]['tokens'], r[eager_reference]['tokens']) for r in records)}/{len(records)}",
            "new_tokens": sum(len(p["tokens"]) for p in per_prompt),
            "reference": arm.reference,
        }
        for baseline in baselines:
            entry[f"speedup_vs_{baseline}"], entry[f"speedup_vs_{baseline}_ci95"] = _throughput_ratio(
                records, arm.label, baseline)
        entry["speedup_vs_reference"], entry["speedup_vs_reference_ci95"] = _throughput_ratio(records, arm.label,
                                                                                            arm.reference)
        summary[arm.label] = entry
    return summary


def format_arms(summary: dict, baselines: list[str]) -> list[str]:
    """Markdown rows: label, ms/token [CI], tau, speedups [CI] (against ``baselines``, then against the arm's own plain
    reference where summaries have it), lossless."""
    own = any("speedup_vs_reference" in entry for entry in summary.values())
    head = (["arm", "ms/token [95% CI]", "tau"] + [f"speedup vs {b} [95% CI]" for b in baselines] +
            (["speedup vs own plain [95% CI]"] if own else []) + ["lossless", "= eager"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, entry in summary.items():
        lo, hi = entry["ms_per_token_ci95"]
        cells = [label, f"{entry['ms_per_token_median']:.1f} [{lo:.1f}, {hi:.1f}]", f"{entry['tau']:.2f}"]
        for key in [f"speedup_vs_{b}" for b in baselines] + (["speedup_vs_reference"] if own else []):
            if key == "speedup_vs_reference" and entry.get("reference", label) == label:
                cells.append("plain")  # a plain arm is its own reference
            elif key in entry:
                lo, hi = entry[f"{key}_ci95"]
                cells.append(f"{entry[key]:.2f}x [{lo:.2f}, {hi:.2f}]")
            else:
                cells.append("")
        cells += [entry["lossless_prompts"], entry["agrees_with_eager_prompts"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
