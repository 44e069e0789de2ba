"""``run_benchmark``: the timing protocol of the package docstring, on already-built models.

A warm-up call of every runner, then prompt by prompt every runner back to back in an order that rotates by
one each prompt; each call is timed with ``time.perf_counter`` (CUDA synchronised) while forward pre-hooks
count the target's and drafters' forwards. Each call becomes one record; ``report.py`` summarises them.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch

from ..data import encode_prompt, stop_token_ids
from ..metrics import SPEEDUP_CONVENTION, TAU_CONVENTION
from ..models import check_compatibility
from . import __doc__ as PROTOCOL  # the package docstring: its counting section is quoted in every report
from .report import _drafter_info, compare, machine_info, summarize_records
from .runners import (
    DEFAULT_METHODS,
    DRAFTER_METHODS,
    HF_CONFIDENCE_THRESHOLD,
    METHODS,
    MODES,
    BenchDrafter,
    CallCounter,
    _hook_assistant,
    close_assistant,
    _make_runners,
)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_mismatch(tokens, reference):
    for index, (a, b) in enumerate(zip(tokens, reference)):
        if a != b:
            return index
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def _timed_call(runner, counter, ids, do_sample, max_new_tokens, seed, device) -> tuple[dict, list[int]]:
    """Time one generation call and count its forwards; returns its record (without the prompt fields) and tokens."""
    before, before_seconds = Counter(counter.calls), Counter(counter.seconds)
    _synchronize(device)
    start = time.perf_counter()
    tokens, extra = runner(ids, do_sample, max_new_tokens, seed)
    _synchronize(device)
    seconds = time.perf_counter() - start
    calls = counter.calls - before
    spent = counter.seconds - before_seconds
    drafter = runner.drafter
    names = () if drafter is None else (f"drafter:{drafter.name}", f"assistant:{drafter.name}")
    drafter_calls = sum(calls[name] for name in names)
    drafter_seconds = sum(spent[name] for name in names)
    verification = calls["target"] - extra.pop("prefill_forwards")  # forwards that yield tokens
    record = {"method": runner.method, "drafter": None if drafter is None else drafter.name, "label": runner.label,
              "prompt_tokens": ids.shape[1], "tokens": len(tokens), "seconds": seconds,
              "tokens_per_second": len(tokens) / seconds, "target_forwards": calls["target"],
              "verification_forwards": verification, "drafter_forwards": drafter_calls,
              "tau": len(tokens) / verification if verification else float("nan"),
              # the decomposition of the call: model forwards and what lies outside them (the loop itself)
              "target_seconds": spent["target"], "drafter_seconds": drafter_seconds,
              "outside_seconds": seconds - spent["target"] - drafter_seconds, **extra}
    return record, tokens


@torch.no_grad()
def run_benchmark(
    target,
    tokenizer,
    drafters: list[BenchDrafter],
    prompts,
    *,
    methods=DEFAULT_METHODS,
    modes=("greedy",),
    max_new_tokens: int = 64,
    warmup_tokens: int = 16,
    seed: int = 0,
    progress: bool = True,
    info: dict | None = None,
) -> dict:
    """Run the protocol on already-built models; returns the report (records, summary, comparisons).

    ``prompts``: rows with ``messages`` (and optionally ``id``), e.g. ``ppow_trl.data.load_prompts(...)``.
    ``target`` is always run (it is every speedup's baseline). ``info`` is merged into ``report["settings"]``.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    unknown = [m for m in list(methods) + list(modes) if m not in METHODS and m not in MODES]
    if unknown or any(m in MODES for m in methods) or any(m in METHODS for m in modes):
        raise ValueError(f"methods must be among {METHODS} and modes among {tuple(MODES)}; got {methods}, {modes}.")
    methods = ["target"] + [m for m in dict.fromkeys(methods) if m != "target"]
    if any(m in DRAFTER_METHODS for m in methods) and not drafters:
        raise ValueError(f"The methods {[m for m in methods if m in DRAFTER_METHODS]} need a drafter; none given.")
    if len({d.name for d in drafters}) != len(drafters):
        raise ValueError(f"Drafter names must be unique, got {[d.name for d in drafters]}.")
    rows = list(prompts)
    if not rows:
        raise ValueError("No prompts to benchmark.")
    device = next(target.parameters()).device
    prompt_ids = [torch.tensor([encode_prompt(tokenizer, row["messages"])], device=device) for row in rows]
    stop_ids = stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    vocab_size = check_compatibility(target, drafters[0].model, tokenizer) if drafters else len(tokenizer)
    lookup_k = drafters[0].policy.max_window if drafters else 8

    records = []
    with ExitStack() as stack:
        # Copies: save_assistant (the hook method) edits the live generation_config in place.
        # (A DFlash drafter is no generative model and has none.)
        originals = {d.name: copy.deepcopy(d.model.generation_config) for d in drafters
                     if getattr(d.model, "generation_config", None) is not None}
        stack.callback(lambda: [setattr(d.model, "generation_config", originals[d.name]) for d in drafters
                                if d.name in originals])
        counter = CallCounter()
        stack.callback(counter.close)
        counter.watch("target", target)
        assistants = {}
        if "hook" in methods:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ppow_bench_")))
            assistants = {d.name: _hook_assistant(d, tokenizer, folder / d.name, target) for d in drafters}
            stack.callback(lambda: [close_assistant(a) for a in assistants.values()])
        for drafter in drafters:
            counter.watch(f"drafter:{drafter.name}", drafter.model)
            if drafter.name in assistants:
                counter.watch(f"assistant:{drafter.name}", assistants[drafter.name])
        runners = _make_runners(methods, drafters, target, stop_ids, pad_id, vocab_size, assistants, lookup_k)

        for mode in modes:
            do_sample = MODES[mode]
            for runner in runners:  # warm-up (untimed); then fresh HF state for the timed calls
                runner.reset()
                if warmup_tokens > 0:
                    runner(prompt_ids[0], do_sample, min(warmup_tokens, max_new_tokens), seed)
                runner.reset()
            iterator = enumerate(prompt_ids)
            if progress:
                from tqdm.auto import tqdm

                iterator = tqdm(iterator, total=len(prompt_ids), desc=f"bench ({mode})", unit="prompt")
            for index, ids in iterator:
                shift = index % len(runners)  # rotate the order: no method always runs first
                timed = [_timed_call(r, counter, ids, do_sample, max_new_tokens, seed + index, device)
                         for r in runners[shift:] + runners[:shift]]
                reference = next(record for record, _ in timed if record["method"] == "target")
                reference_tokens = next(tokens for record, tokens in timed if record is reference)
                for record, tokens in timed:
                    mismatch = None if do_sample else _first_mismatch(tokens, reference_tokens)
                    record.update(mode=mode, prompt_index=index, prompt_id=str(rows[index].get("id", index)),
                                  speedup=record["tokens_per_second"] / reference["tokens_per_second"],
                                  lossless=None if do_sample else mismatch is None, first_mismatch=mismatch)
                    records.append(record)

    settings = {"methods": methods, "modes": list(modes), "max_new_tokens": max_new_tokens,
                "warmup_tokens": warmup_tokens, "seed": seed, "num_prompts": len(rows), "batch_size": 1,
                "prompt_lookup_num_tokens": lookup_k, "hf_confidence_threshold": HF_CONFIDENCE_THRESHOLD,
                "sklearn": _has_module("sklearn"), "stop_token_ids": stop_ids, **(info or {})}
    report = {
        "protocol": {"tau": TAU_CONVENTION, "speedup": SPEEDUP_CONVENTION,
                     "counting": PROTOCOL[PROTOCOL.index("How tau is counted"):].strip()},
        "settings": settings,
        "machine": machine_info(device),
        "drafters": [_drafter_info(d) for d in drafters],
        "records": records,
    }
    report["summary"] = summarize_records(records)
    report["comparisons"] = compare(records)
    return report


def _has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None

