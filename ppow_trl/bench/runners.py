"""The benchmarked methods (see the package docstring): one ``_Runner`` per (method, drafter) pair.

A runner generates one prompt's continuation with its method and returns the new tokens plus the loop's own
statistics; ``CallCounter`` counts the models' forwards while it runs (``timing.py`` reads both).
"""

from __future__ import annotations

import copy
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.cost import CostModel
from ..drafting import family_of
from ..serving.generation import speculative_generate
from ..core.windowing import AdaptiveWindowPolicy

METHODS = (
    "target", "hf_assisted", "hf_heuristic", "hf_confidence", "prompt_lookup", "hook", "fast_fixed", "fast_adaptive",
    "fast_plain",
)
DRAFTER_METHODS = ("hf_assisted", "hf_heuristic", "hf_confidence", "hook", "fast_fixed", "fast_adaptive")
FAST_METHODS = ("fast_fixed", "fast_adaptive", "fast_plain")
DEFAULT_METHODS = ("target", "hf_assisted", "fast_fixed", "fast_adaptive")
MODES = {"greedy": False, "sample": True}  # mode -> do_sample; sampling is at temperature 1
HF_CONFIDENCE_THRESHOLD = 0.4  # transformers' default assistant_confidence_threshold


@dataclass
class BenchDrafter:
    """A drafter under test: its model, its window policy (K, h), and optionally its measured cost model."""

    name: str
    model: torch.nn.Module
    policy: AdaptiveWindowPolicy
    cost_model: CostModel | None = None
    source: str = ""


class CallCounter:
    """Counts calls of modules and the seconds spent in them, through forward pre- and post-hooks
    (``calls[name]``, ``seconds[name]``); ``close()`` removes them. The timing is what a round decomposes into:
    target forwards, drafter forwards, and the rest (the loop itself: sampling, verification, bookkeeping)."""

    def __init__(self):
        self.calls = Counter()
        self.seconds = Counter()
        self._started = {}
        self._handles = []

    def watch(self, name: str, module: torch.nn.Module) -> None:
        def before(_module, _args, name=name):
            self.calls[name] += 1
            self._started[name] = time.perf_counter()

        def after(_module, _args, _output, name=name):
            start = self._started.pop(name, None)
            if start is not None:
                self.seconds[name] += time.perf_counter() - start

        self._handles.append(module.register_forward_pre_hook(before))
        self._handles.append(module.register_forward_hook(after))

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
        if self.method in HF_SCHEDULES and not _native_kwargs(self.drafter):
            self.hf_config = _assistant_config(self.drafter, *HF_SCHEDULES[self.method])

    def __call__(self, input_ids, do_sample: bool, max_new_tokens: int, seed: int):
        if self.method in FAST_METHODS:
            return self._fast(input_ids, do_sample, max_new_tokens, seed)
        kwargs = {}
        if self.method in HF_SCHEDULES and _native_kwargs(self.drafter):
            # the family's own route in stock transformers (DFlash: the fixed block of block_size - 1 tokens)
            kwargs.update(assistant_model=self.drafter.model, **_native_kwargs(self.drafter))
        elif self.method in HF_SCHEDULES:
            self.drafter.model.generation_config = self.hf_config  # HF reads the window options from here
            kwargs["assistant_model"] = self.drafter.model
        elif self.method == "hook":
            kwargs["assistant_model"] = self.assistant
            kwargs.update(_native_kwargs(self.drafter))  # with load_assistant's adaptive window
        elif self.method == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = self.k
        torch.manual_seed(seed)
        out = self.target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id, **_sampling_kwargs(do_sample), **kwargs,
        )
        return out[0, input_ids.shape[1]:].tolist(), {"prefill_forwards": 0}

    def _fast(self, input_ids, do_sample, max_new_tokens, seed):
        if self.method == "fast_plain":  # our loop with K = 0: plain decoding, the loop's own overhead
            policy, model = AdaptiveWindowPolicy(max_window=0), self.target
        else:
            policy, model = self.drafter.policy, self.drafter.model
        if self.method == "fast_fixed":
            policy = AdaptiveWindowPolicy(max_window=policy.max_window, threshold=0.0)
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
        out = speculative_generate(
            self.target, model, input_ids, policy=policy, max_new_tokens=max_new_tokens,
            do_sample=do_sample, temperature=1.0, eos_token_id=self.stop_ids, vocab_size=self.vocab_size,
            generator=generator,
        )
        extra = {"prefill_forwards": out.prefill_forwards, "loop_target_forwards": out.target_forwards,
                 "rounds": out.num_rounds, "loop_tau": out.tau, "max_window": out.max_window,
                 "accepted_per_round": out.accepted_per_round, "window_lengths": out.window_lengths,
                 "guard_decisions": out.guard_decisions}
        return out.new_tokens, extra


def _native_kwargs(drafter: BenchDrafter | None) -> dict:
    """The ``target.generate`` arguments of the drafter family's own transformers route (empty: HF's assistant)."""
    return {} if drafter is None else dict(family_of(drafter.model).hf_generate_kwargs)


def applies(method: str, drafter: BenchDrafter | None) -> bool:
    """Whether ``method`` can run ``drafter``: HF's own assistant schedules call the drafter's ``generate`` as a
    causal LM, which a chain drafter reading the target's hidden states cannot do (it runs as ``hook`` and
    ``fast_*``). A DFlash block drafter runs ``hf_assisted`` as stock transformers' ``speculation_type="dflash"``
    (the fixed block); HF's other schedules do not exist for it."""
    if drafter is None or method not in HF_SCHEDULES:
        return True
    allowed = family_of(drafter.model).hf_methods
    return allowed is None or method in allowed


def _make_runners(methods, drafters, target, stop_ids, pad_id, vocab_size, assistants, lookup_k):
    runners = []
    for method in methods:
        for drafter in (drafters if method in DRAFTER_METHODS else [None]):
            if not applies(method, drafter):
                print(f"[bench] {method} skipped for {drafter.name}: it reads the target's hidden states, which HF's "
                      "own assistant schedules do not hand it (measured under 'hook' and 'fast_*'; a DFlash drafter "
                      "also under 'hf_assisted', stock transformers' fixed block).", file=sys.stderr)
                continue
            assistant = assistants.get(drafter.name) if drafter is not None else None
            runners.append(_Runner(method, drafter, target, stop_ids, pad_id, vocab_size, lookup_k, assistant))
    return runners


def _hook_assistant(drafter: BenchDrafter, tokenizer, folder: Path, target=None):
    """Save ``drafter`` with ``ppow_trl.serving.assisted`` and load it back (imported here: the module is optional); a
    feature-conditioned drafter is attached to ``target`` (its hooks are removed with ``close_assistant``)."""
    from ..serving.assisted import load_assistant, save_assistant

    original = copy.deepcopy(getattr(drafter.model, "generation_config", None))  # save_assistant sets it in memory
    try:
        save_assistant(drafter.model, folder, policy=drafter.policy, cost_model=drafter.cost_model, tokenizer=tokenizer)
    finally:
        if original is not None:
            drafter.model.generation_config = original
    parameter = next(drafter.model.parameters())
    return load_assistant(folder, target=target).to(device=parameter.device, dtype=parameter.dtype).eval()


def close_assistant(assistant) -> None:
    """Remove the target hooks of a feature-conditioned assistant (a no-op for the others)."""
    family_of(assistant).detach(assistant)

