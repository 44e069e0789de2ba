"""Benchmark of the evaluation protocol (design/PPOW.md): speculative decoding methods vs the target alone.

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
  hook           our saved drafter through HF's ``assistant_model`` (``ppow_trl.assisted``: our window rule).
  fast_fixed     ``ppow_trl.speculative_generate`` with a fixed window (threshold 0).
  fast_adaptive  ``ppow_trl.speculative_generate`` with the drafter's policy.
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

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .cost import CostModel, calibrate_cost_model
from .data import PROMPT_SOURCES, encode_prompt, load_prompts, stop_token_ids
from .generation import speculative_generate
from .metrics import SPEEDUP_CONVENTION, TAU_CONVENTION, summarize
from .models import check_compatibility, load_target, make_drafter
from .utils import set_cpu_threads
from .windowing import WINDOW_POLICY_FILE, AdaptiveWindowPolicy

METHODS = (
    "target", "hf_assisted", "hf_heuristic", "hf_confidence", "prompt_lookup", "hook", "fast_fixed", "fast_adaptive"
)
DRAFTER_METHODS = ("hf_assisted", "hf_heuristic", "hf_confidence", "hook", "fast_fixed", "fast_adaptive")
FAST_METHODS = ("fast_fixed", "fast_adaptive")
DEFAULT_METHODS = ("target", "hf_assisted", "fast_fixed", "fast_adaptive")
MODES = {"greedy": False, "sample": True}  # mode -> do_sample; sampling is at temperature 1
HF_CONFIDENCE_THRESHOLD = 0.4  # transformers' default assistant_confidence_threshold
# (method, baseline): figures reported as median/p25/p75 of per-prompt tokens/s ratios
COMPARISONS = (("fast_fixed", "hf_assisted"), ("fast_adaptive", "hf_assisted"), ("hook", "hf_assisted"),
               ("fast_adaptive", "fast_fixed"), ("fast_adaptive", "hf_confidence"), ("hook", "fast_adaptive"))


@dataclass
class BenchDrafter:
    """A drafter under test: its model, its window policy (K, h), and optionally its measured cost model."""

    name: str
    model: torch.nn.Module
    policy: AdaptiveWindowPolicy
    cost_model: CostModel | None = None
    source: str = ""


class CallCounter:
    """Counts calls of modules through forward pre-hooks (``calls[name]``); ``close()`` removes them."""

    def __init__(self):
        self.calls = Counter()
        self._handles = []

    def watch(self, name: str, module: torch.nn.Module) -> None:
        def hook(_module, _args, name=name):
            self.calls[name] += 1

        self._handles.append(module.register_forward_pre_hook(hook))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _sampling_kwargs(do_sample: bool) -> dict:
    """Raw argmax, or the target's raw distribution at T = 1 (override checkpoint defaults such as top-k 50 or a
    repetition penalty, which the fast loop does not apply)."""
    if not do_sample:
        return {"do_sample": False, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
    return {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0}


def _assistant_config(drafter: BenchDrafter, schedule: str, threshold: float):
    config = copy.deepcopy(drafter.model.generation_config)
    config.num_assistant_tokens = drafter.policy.max_window
    config.num_assistant_tokens_schedule = schedule
    config.assistant_confidence_threshold = threshold
    return config


HF_SCHEDULES = {"hf_assisted": ("constant", 0.0), "hf_heuristic": ("heuristic", 0.0),
                "hf_confidence": ("constant", HF_CONFIDENCE_THRESHOLD)}


class _Runner:
    """Runs one (method, drafter) on a prompt: returns ``(new_tokens, extra)`` where extra holds loop stats."""

    def __init__(self, method, drafter, target, stop_ids, pad_id, vocab_size, k, assistant=None):
        self.method, self.drafter, self.target = method, drafter, target
        self.stop_ids, self.pad_id, self.vocab_size, self.assistant = stop_ids, pad_id, vocab_size, assistant
        self.k = drafter.policy.max_window if drafter is not None else k
        self.label = method if drafter is None else f"{method}[{drafter.name}]"
        self.hf_config = None

    def reset(self) -> None:
        """Fresh HF window settings (HF's heuristic K persists across calls otherwise)."""
        if self.method in HF_SCHEDULES:
            self.hf_config = _assistant_config(self.drafter, *HF_SCHEDULES[self.method])

    def __call__(self, input_ids, do_sample: bool, max_new_tokens: int, seed: int):
        if self.method in FAST_METHODS:
            return self._fast(input_ids, do_sample, max_new_tokens, seed)
        kwargs = {}
        if self.method in HF_SCHEDULES:
            self.drafter.model.generation_config = self.hf_config  # HF reads the window options from here
            kwargs["assistant_model"] = self.drafter.model
        elif self.method == "hook":
            kwargs["assistant_model"] = self.assistant
        elif self.method == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = self.k
        torch.manual_seed(seed)
        out = self.target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **_sampling_kwargs(do_sample), **kwargs,
        )
        return out[0, input_ids.shape[1]:].tolist(), {"prefill_forwards": 0}

    def _fast(self, input_ids, do_sample, max_new_tokens, seed):
        policy = self.drafter.policy
        if self.method == "fast_fixed":
            policy = AdaptiveWindowPolicy(max_window=policy.max_window, threshold=0.0)
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
        out = speculative_generate(
            self.target, self.drafter.model, input_ids, policy=policy, max_new_tokens=max_new_tokens,
            do_sample=do_sample, temperature=1.0, eos_token_id=self.stop_ids, vocab_size=self.vocab_size,
            generator=generator,
        )
        extra = {"prefill_forwards": out.prefill_forwards, "loop_target_forwards": out.target_forwards,
                 "rounds": out.num_rounds, "loop_tau": out.tau, "max_window": out.max_window,
                 "accepted_per_round": out.accepted_per_round, "window_lengths": out.window_lengths}
        return out.new_tokens, extra


def _make_runners(methods, drafters, target, stop_ids, pad_id, vocab_size, assistants, lookup_k):
    runners = []
    for method in methods:
        for drafter in (drafters if method in DRAFTER_METHODS else [None]):
            assistant = assistants.get(drafter.name) if drafter is not None else None
            runners.append(_Runner(method, drafter, target, stop_ids, pad_id, vocab_size, lookup_k, assistant))
    return runners


def _hook_assistant(drafter: BenchDrafter, tokenizer, folder: Path):
    """Save ``drafter`` with ``ppow_trl.assisted`` and load it back (imported here: the module is optional)."""
    from .assisted import load_assistant, save_assistant

    original = copy.deepcopy(drafter.model.generation_config)  # save_assistant also sets the in-memory config
    try:
        save_assistant(drafter.model, folder, policy=drafter.policy, cost_model=drafter.cost_model, tokenizer=tokenizer)
    finally:
        drafter.model.generation_config = original
    parameter = next(drafter.model.parameters())
    return load_assistant(folder).to(device=parameter.device, dtype=parameter.dtype).eval()


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
    before = Counter(counter.calls)
    _synchronize(device)
    start = time.perf_counter()
    tokens, extra = runner(ids, do_sample, max_new_tokens, seed)
    _synchronize(device)
    seconds = time.perf_counter() - start
    calls = counter.calls - before
    drafter = runner.drafter
    drafter_calls = 0 if drafter is None else calls[f"drafter:{drafter.name}"] + calls[f"assistant:{drafter.name}"]
    verification = calls["target"] - extra.pop("prefill_forwards")  # forwards that yield tokens
    record = {"method": runner.method, "drafter": None if drafter is None else drafter.name, "label": runner.label,
              "prompt_tokens": ids.shape[1], "tokens": len(tokens), "seconds": seconds,
              "tokens_per_second": len(tokens) / seconds, "target_forwards": calls["target"],
              "verification_forwards": verification, "drafter_forwards": drafter_calls,
              "tau": len(tokens) / verification if verification else float("nan"), **extra}
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
        originals = {d.name: copy.deepcopy(d.model.generation_config) for d in drafters}
        stack.callback(lambda: [setattr(d.model, "generation_config", originals[d.name]) for d in drafters])
        counter = CallCounter()
        stack.callback(counter.close)
        counter.watch("target", target)
        assistants = {}
        if "hook" in methods:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ppow_bench_")))
            assistants = {d.name: _hook_assistant(d, tokenizer, folder / d.name) for d in drafters}
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
                     "counting": __doc__[__doc__.index("How tau is counted"):].strip()},
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


def _drafter_info(drafter: BenchDrafter) -> dict:
    cost = drafter.cost_model
    return {"name": drafter.name, "source": drafter.source, "policy": dict(vars(drafter.policy)),
            "parameters": sum(p.numel() for p in drafter.model.parameters()),
            "cost_ratio": None if cost is None else cost.drafter_cost,
            "verify_cost": None if cost is None else cost.verify_cost}


def _group(records, keys):
    groups = defaultdict(list)
    for record in records:
        groups[tuple(record[k] for k in keys)].append(record)
    return groups


def summarize_records(records) -> list[dict]:
    """One row per (mode, method, drafter): ``ppow_trl.metrics.summarize`` plus losslessness and histograms."""
    by_prompt = {(r["mode"], r["prompt_index"]): r for r in records if r["method"] == "target"}
    rows = []
    for (mode, label), group in _group(records, ("mode", "label")).items():
        baseline = [by_prompt[(mode, r["prompt_index"])] for r in group]
        row = {"mode": mode, "method": group[0]["method"], "drafter": group[0]["drafter"], "label": label,
               **summarize([r["tokens"] for r in group], [r["verification_forwards"] for r in group],
                           [r["seconds"] for r in group], [b["tokens"] for b in baseline],
                           [b["seconds"] for b in baseline])}
        flags = [r["lossless"] for r in group if r["lossless"] is not None]
        row["lossless"] = all(flags) if flags else None
        row["lossless_prompts"] = f"{sum(flags)}/{len(flags)}" if flags else None
        row["drafter_forwards"] = sum(r["drafter_forwards"] for r in group)
        if row["method"] in FAST_METHODS:
            k = group[0]["max_window"]
            accepted = [a for r in group for a in r["accepted_per_round"]]
            windows = [w for r in group for w in r["window_lengths"]]
            row["acceptance_histogram"] = [accepted.count(a) for a in range(k + 1)]
            row["window_length_histogram"] = [windows.count(length) for length in range(k + 1)]
            row["mean_accepted"] = sum(accepted) / max(len(accepted), 1)
            row["mean_window_length"] = sum(windows) / max(len(windows), 1)
        rows.append(row)
    modes = list(dict.fromkeys(r["mode"] for r in records))
    return sorted(rows, key=lambda row: (modes.index(row["mode"]), METHODS.index(row["method"]), row["drafter"] or ""))


def compare(records) -> list[dict]:
    """Per-prompt tokens/s ratios of method pairs (same drafter, same mode; ``COMPARISONS``): median and spread."""
    index = {(r["mode"], r["method"], r["drafter"], r["prompt_index"]): r for r in records}
    drafters = sorted({r["drafter"] for r in records if r["drafter"] is not None})
    out = []
    for mode in dict.fromkeys(r["mode"] for r in records):
        for method, baseline in COMPARISONS:
            for drafter in drafters:
                other = drafter if baseline in DRAFTER_METHODS else None
                pairs = [(r, index.get((mode, baseline, other, r["prompt_index"])))
                         for r in records if (r["mode"], r["method"], r["drafter"]) == (mode, method, drafter)]
                pairs = [(a, b) for a, b in pairs if b is not None]
                if not pairs:
                    continue
                stats = summarize([a["tokens"] for a, _ in pairs], [a["verification_forwards"] for a, _ in pairs],
                                  [a["seconds"] for a, _ in pairs], [b["tokens"] for _, b in pairs],
                                  [b["seconds"] for _, b in pairs])
                out.append({"mode": mode, "drafter": drafter, "method": method, "baseline": baseline,
                            "ratio_median": stats["speedup_median"], "ratio_p25": stats["speedup_p25"],
                            "ratio_p75": stats["speedup_p75"], "num_prompts": stats["num_prompts"]})
    return out


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu": _cpu_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "device": str(device), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["evaluate"] = importlib.metadata.version("evaluate")
    except importlib.metadata.PackageNotFoundError:
        pass
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---------------------------------------------------------------------------------------------------------
# Outputs: JSON, Markdown, PNG
# ---------------------------------------------------------------------------------------------------------


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def format_markdown(report: dict) -> str:
    settings, machine = report["settings"], report["machine"]
    lines = [
        "# Speculative decoding benchmark (`python -m ppow_trl.bench`)", "",
        f"Command: `{settings.get('command', 'run_benchmark(...)')}`", "",
        f"Target: {settings.get('target', '?')} ({settings.get('precision', '?')}), {settings['num_prompts']} prompts "
        f"({settings.get('prompts', '?')}), max_new_tokens={settings['max_new_tokens']}, batch 1, "
        f"{machine['torch_threads']} torch thread(s), {machine['device']} ({machine['cpu']}), "
        f"torch {machine['torch']}, "
        f"transformers {machine['transformers']}, {machine['date']}.", "",
        f"- {report['protocol']['tau']}.", f"- {report['protocol']['speedup']}; p25-p75 in brackets.",
        "- lossless: greedy output equal to the target's greedy output, token for token (prompts).", "",
        "| mode | method | drafter | speedup median [p25, p75] | tokens/s median | tau | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        lines.append(
            f"| {row['mode']} | {row['method']} | {row['drafter'] or '-'} | {_fmt(row['speedup_median'])} "
            f"[{_fmt(row['speedup_p25'])}, {_fmt(row['speedup_p75'])}] | {_fmt(row['tokens_per_second_median'], 1)} "
            f"| {_fmt(row['tau'])} | {row['lossless_prompts'] or 'n/a (sampling)'} |")
    if report["comparisons"]:
        lines += ["", "Same drafter, same K, same prompts: per-prompt tokens/s ratio.", "",
                  "| mode | drafter | method / baseline | median [p25, p75] |", "|---|---|---|---|"]
        for c in report["comparisons"]:
            lines.append(f"| {c['mode']} | {c['drafter']} | {c['method']} / {c['baseline']} | "
                         f"{_fmt(c['ratio_median'])} [{_fmt(c['ratio_p25'])}, {_fmt(c['ratio_p75'])}] |")
    if report["drafters"]:
        lines += ["", "| drafter | K | h | parameters | cost ratio t_d/t_t | source |", "|---|---|---|---|---|---|"]
        for d in report["drafters"]:
            lines.append(f"| {d['name']} | {d['policy']['max_window']} | {d['policy']['threshold']} | "
                         f"{d['parameters'] / 1e6:.1f}M | {_fmt(d['cost_ratio'], 3)} | {d['source']} |")
    fast = [row for row in report["summary"] if "acceptance_histogram" in row]
    if fast:
        lines += ["", "Fast loop: rounds by accepted length A and by window length L (0..K).", "",
                  "| mode | method | drafter | mean A | mean L | A histogram | L histogram |",
                  "|---|---|---|---|---|---|---|"]
        for row in fast:
            lines.append(f"| {row['mode']} | {row['method']} | {row['drafter']} | {_fmt(row['mean_accepted'])} | "
                         f"{_fmt(row['mean_window_length'])} | {row['acceptance_histogram']} | "
                         f"{row['window_length_histogram']} |")
    return "\n".join(lines) + "\n"


def plot_histograms(report: dict, path) -> Path | None:
    """Acceptance-length and window-length histograms (fraction of rounds) of the fast loops; None if none ran."""
    rows = [row for row in report["summary"] if "acceptance_histogram" in row]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(rows)
    for panel, (key, title) in enumerate((("acceptance_histogram", "accepted tokens A per round"),
                                          ("window_length_histogram", "window length L per round"))):
        for i, row in enumerate(rows):
            counts = row[key]
            total = max(sum(counts), 1)
            positions = [x + (i - (len(rows) - 1) / 2) * width for x in range(len(counts))]
            axes[panel].bar(positions, [c / total for c in counts], width=width,
                            label=f"{row['method']} [{row['drafter']}] {row['mode']}")
        axes[panel].set_xlabel(title)
        axes[panel].set_ylabel("fraction of rounds")
        axes[panel].set_xticks(range(max(len(row[key]) for row in rows)))
    axes[0].legend(fontsize=8)
    figure.suptitle(f"ppow_trl fast loop, {report['settings'].get('target', '')}", fontsize=10)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_outputs(report: dict, prefix) -> dict:
    """Write ``prefix.json``, ``prefix.md`` and ``prefix.png``; returns the paths written."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": prefix.with_suffix(".json"), "markdown": prefix.with_suffix(".md")}
    paths["json"].write_text(json.dumps(report, indent=1, default=str))
    paths["markdown"].write_text(format_markdown(report))
    png = plot_histograms(report, prefix.with_suffix(".png"))
    if png is not None:
        paths["png"] = png
    return paths


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ppow_trl.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target path or Hub id (default: offline SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", choices=("4bit", "8bit"), default=None, help="bitsandbytes target")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--drafter", action="append", default=[], metavar="PATH",
                        help="drafter folder (repeatable); its ppow_window_policy.json gives K and h")
    parser.add_argument("--drafter-layers", type=int, action="append", default=[], metavar="N",
                        help="truncated drafter: the target's first N layers (repeatable; default 2 if no --drafter)")
    parser.add_argument("--max-window", type=int, default=6, help="K for drafters without a saved policy")
    parser.add_argument("--threshold", type=float, default=0.4, help="h for drafters without a saved policy")
    parser.add_argument("--prompts", default="mtbench", help=f"one of {PROMPT_SOURCES} or a .jsonl file")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["greedy", "sample"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS))
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--cost-repeats", type=int, default=5,
                        help="repeats of calibrate_cost_model for drafters without a saved cost model (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="outputs/bench/bench", help="output prefix: writes .json, .md, .png")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse_args(argv=None):
    """Parse and check the arguments (before any model is loaded): errors exit with a usage message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0:
        parser.error(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}.")
    if args.num_prompts <= 0:
        parser.error(f"--num-prompts must be a positive integer, got {args.num_prompts}.")
    if args.prompts not in PROMPT_SOURCES and not Path(args.prompts).is_file():
        parser.error(f"--prompts {args.prompts}: no such file. Use one of {PROMPT_SOURCES} or a path to a .jsonl file.")
    for path in args.drafter:
        if not Path(path).is_dir():
            parser.error(f"--drafter {path}: no such folder (a drafter saved by ppow_trl / save_pretrained).")
    if any(n <= 0 for n in args.drafter_layers):
        parser.error("--drafter-layers must be positive.")
    try:
        AdaptiveWindowPolicy(max_window=args.max_window, threshold=args.threshold)
    except ValueError as error:
        parser.error(str(error))
    if not args.drafter and not args.drafter_layers:
        args.drafter_layers = [2]
    return args


def load_bench_prompts(source: str, num_prompts: int, seed: int = 0):
    """Prompt rows: MT-bench ordered one category after another (first 8 cover the 8 categories), else
    ``load_prompts(source, num_prompts, seed)``."""
    if source == "mtbench":
        prompts = load_prompts("mtbench")
        order = sorted(range(len(prompts)), key=lambda i: (i % 10, i))
        return prompts.select(order[:num_prompts])
    return load_prompts(source, num_samples=num_prompts, seed=seed)


def _load_drafters(args, target, tokenizer, dtype) -> list[BenchDrafter]:
    drafters = []
    default_policy = AdaptiveWindowPolicy(max_window=args.max_window, threshold=args.threshold)
    for path in args.drafter:
        model = load_target(path, torch_dtype=dtype).to(next(target.parameters()).device)
        has_policy = (Path(path) / WINDOW_POLICY_FILE).is_file()
        policy = AdaptiveWindowPolicy.from_pretrained(path) if has_policy else default_policy
        if not has_policy:
            print(f"[bench] {path} has no {WINDOW_POLICY_FILE}: using K={policy.max_window}, h={policy.threshold}",
                  file=sys.stderr)
        cost = CostModel.from_pretrained(path) if (Path(path) / "ppow_cost_model.json").is_file() else None
        drafters.append(BenchDrafter(Path(path).name, model, policy, cost, source=str(path)))
    source = target
    if args.drafter_layers and getattr(target, "hf_quantizer", None) is not None:
        source = load_target(args.target_path, torch_dtype=dtype).to(next(target.parameters()).device)
    for layers in args.drafter_layers:
        model = make_drafter(source, num_layers=layers).requires_grad_(False)
        drafters.append(BenchDrafter(f"layers{layers}", model, default_policy,
                                     source=f"first {layers} layers of the target (untrained)"))
    for drafter in drafters:
        check_compatibility(target, drafter.model, tokenizer)
    return drafters


def _calibrate(drafters, target, context_ids, repeats: int) -> None:
    for drafter in drafters:
        if drafter.cost_model is None and repeats > 0:
            drafter.cost_model = calibrate_cost_model(target, drafter.model, drafter.policy.max_window,
                                                      context_ids=context_ids, repeats=repeats, warmup=1)


def main(argv=None, *, target=None, tokenizer=None, drafters: list[BenchDrafter] | None = None) -> dict:
    """The CLI. ``target``/``tokenizer``/``drafters`` may be given already built (tests); then ``--target`` and
    ``--drafter*`` are ignored (no drafters given: they are built from ``--drafter-layers``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    threads = set_cpu_threads()
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's "flag ignored" warnings would drown the progress bar
    try:
        return _main(args, argv, threads, target, tokenizer, drafters)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _main(args, argv, threads, target, tokenizer, drafters) -> dict:
    import transformers

    dtype = getattr(torch, args.dtype)
    if target is None or tokenizer is None:
        from .offline import smollm2_path

        args.target_path = args.target or str(smollm2_path())
    else:
        args.target_path = args.target or getattr(target, "name_or_path", "") or type(target).__name__
    if target is None:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        target = load_target(args.target_path, quantization=args.quantization, torch_dtype=dtype,
                             device_map=device if args.quantization else None)
        if not args.quantization:
            target = target.to(device)
    if tokenizer is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.target_path)
    prompts = load_bench_prompts(args.prompts, args.num_prompts, args.seed)
    if drafters is None:
        drafters = _load_drafters(args, target, tokenizer, dtype)
    device = next(target.parameters()).device
    first = torch.tensor([encode_prompt(tokenizer, prompts[0]["messages"])], device=device)
    _calibrate(drafters, target, first, args.cost_repeats)
    precision = str(target.dtype).removeprefix("torch.") + (f", {args.quantization}" if args.quantization else "")
    info = {"command": "python -m ppow_trl.bench " + shlex.join(argv), "target": args.target_path,
            "precision": precision, "prompts": args.prompts, "threads": threads}
    report = run_benchmark(target, tokenizer, drafters, prompts, methods=args.methods, modes=args.modes,
                           max_new_tokens=args.max_new_tokens, warmup_tokens=args.warmup_tokens, seed=args.seed,
                           progress=not args.no_progress, info=info)
    paths = write_outputs(report, args.output)
    print(format_markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report


if __name__ == "__main__":
    main()
