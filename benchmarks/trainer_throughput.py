"""PPOWTrainer throughput on SmolLM2-135M-Instruct (fp32, CPU) with a truncated drafter.

Measured in one run:
1. Rollout + verification of one generation batch, with the shared-context KV cache (each context
   prefilled once for its G windows) vs without (each window re-reads its context), interleaved,
   medians: windows scored per second.
2. Full PPOWTrainer training steps (rollout, verification, rewards, loss forward/backward, optimizer) with
   the loss's log-probs from TRL's generic path (`shared_context_logprobs=False`: each of the G windows
   recomputes its context) and from the shared-context path (each context once per micro-batch),
   interleaved in chunks of steps, median seconds per step (the step-0 selection refresh excluded), and
   the share of time in target forwards.
3. Peak memory of a training run of each arm, each in its own subprocess (peak RSS during `train()`, the
   kernel's VmHWM reset just before it, minus the RSS before it; Linux only).

    python benchmarks/trainer_throughput.py --out benchmarks/results/trainer_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback

from ppow_trl import PPOWConfig, PPOWTrainer
from ppow_trl.core.cost import CostModel
from ppow_trl.data import build_target_responses, load_mtbench
from ppow_trl.models import load_target, make_drafter
from ppow_trl.offline import smollm2_path
from ppow_trl.core.rollout import draft_windows, target_window_probs
from ppow_trl.utils import cache_root, set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy

ARMS = {"trl_generic": False, "shared_context": True}


class ForwardTimer:
    """Accumulates wall time spent inside a module's forward (pre/post hooks)."""

    def __init__(self, module):
        self.seconds, self.calls, self._start = 0.0, 0, None
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *args):
        self._start = time.perf_counter()

    def _post(self, *args):
        self.seconds += time.perf_counter() - self._start
        self.calls += 1


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step, and the target-forward time inside it."""

    def __init__(self, target_timer: ForwardTimer):
        self.target_timer, self.steps = target_timer, []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._target = time.perf_counter(), self.target_timer.seconds

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append({"step": state.global_step, "s": time.perf_counter() - self._start,
                           "target_s": self.target_timer.seconds - self._target})


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--contexts", type=int, default=4, help="contexts per generation batch")
    parser.add_argument("--group", type=int, default=8, help="G windows per context")
    parser.add_argument("--max-window", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5, help="rollout timing repeats")
    parser.add_argument("--chunks", type=int, default=3, help="training chunks per arm (interleaved)")
    parser.add_argument("--steps-per-chunk", type=int, default=3, help="training steps per chunk (first excluded)")
    parser.add_argument("--memory-arm", choices=sorted(ARMS), help=argparse.SUPPRESS)  # subprocess mode
    parser.add_argument("--out", default="benchmarks/results/trainer_throughput.json")
    return parser.parse_args(argv)


def setup(args):
    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = load_mtbench().select(range(0, 80, 10))
    data = build_target_responses(target, tokenizer, prompts, max_new_tokens=96, batch_size=4,
                                  cache_dir=cache_root() / "responses")
    return target, tokenizer, data


def make_drafter_for(target, args):
    draft_vocab = torch.arange(args.draft_vocab_size) if args.draft_vocab_size else None
    return make_drafter(target, num_layers=args.drafter_layers, draft_vocab_ids=draft_vocab)


def make_trainer(target, tokenizer, data, args, shared: bool, steps: int, callbacks=(), cost_model=None):
    windows = args.contexts * args.group
    config = PPOWConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=windows, num_generations=args.group,
                        max_window=args.max_window, max_steps=steps, learning_rate=1e-5, logging_steps=1,
                        report_to="none", save_strategy="no", selection_refresh_steps=10_000,
                        selection_refresh_sequences=len(data), disable_tqdm=True, calibrate_window=False,
                        shared_context_logprobs=shared)
    return PPOWTrainer(model=make_drafter_for(target, args), target_model=target, args=config, train_dataset=data,
                       processing_class=tokenizer, callbacks=list(callbacks), cost_model=cost_model)


def memory_run(args) -> None:
    """Subprocess mode: one training run of one arm; prints the peak RSS during ``train()`` above the RSS before it
    (MiB). The kernel's peak (VmHWM) is reset just before training (``/proc/self/clear_refs``), so loading the
    models does not count."""
    set_cpu_threads()
    target, tokenizer, data = setup(args)
    trainer = make_trainer(target, tokenizer, data, args, ARMS[args.memory_arm], steps=3,
                           cost_model=CostModel(drafter_cost=0.1, verify_cost=[1.0] * (args.max_window + 1)))
    before = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    trainer.train()
    peak = _status_mib("VmHWM")
    print(json.dumps({"arm": args.memory_arm, "rss_before_train_mib": before, "peak_during_train_mib": peak,
                      "peak_above_start_mib": peak - before}))


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status (kB) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def rollout_timings(target, tokenizer, data, args) -> dict:
    drafter = make_drafter_for(target, args)
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    policy = AdaptiveWindowPolicy(args.max_window)
    contexts = [torch.tensor(p + r[: len(r) // 2]) for p, r in zip(data["prompt_ids"], data["response_ids"])][: args.contexts]

    def rollout(shared: bool):
        g = torch.Generator().manual_seed(0)
        if shared:
            d = draft_windows(drafter, contexts, policy, pad_id=pad, vocab_size=vocab, generator=g,
                              num_samples_per_context=args.group)
            target_window_probs(target, contexts, d.window_ids, pad_id=pad, vocab_size=vocab,
                                num_samples_per_context=args.group)
        else:
            repeated = [c for c in contexts for _ in range(args.group)]
            d = draft_windows(drafter, repeated, policy, pad_id=pad, vocab_size=vocab, generator=g)
            target_window_probs(target, repeated, d.window_ids, pad_id=pad, vocab_size=vocab)

    timings = {"shared_kv": [], "no_reuse": []}
    with torch.inference_mode():
        rollout(True)
        for _ in range(args.repeats):
            for name, shared in (("shared_kv", True), ("no_reuse", False)):
                start = time.perf_counter()
                rollout(shared)
                timings[name].append(time.perf_counter() - start)
    windows = args.contexts * args.group
    return {"context_tokens": [len(c) for c in contexts],
            **{name: {"median_s": statistics.median(v), "windows_per_s": windows / statistics.median(v), "all_s": v}
               for name, v in timings.items()}}


def training_timings(target, tokenizer, data, args) -> dict:
    timer = ForwardTimer(target)
    cost_model = None
    steps = {arm: [] for arm in ARMS}
    for _ in range(args.chunks):
        for arm, shared in ARMS.items():
            step_timer = StepTimer(timer)
            trainer = make_trainer(target, tokenizer, data, args, shared, args.steps_per_chunk, [step_timer], cost_model)
            trainer.train()
            cost_model = trainer.cost_model  # measured once, then shared: same rewards in every chunk
            steps[arm] += step_timer.steps[1:]  # the first step of a chunk runs the selection refresh
            print(arm, [round(s["s"], 2) for s in step_timer.steps], flush=True)
    windows = args.contexts * args.group
    summary = {}
    for arm, rows in steps.items():
        median = statistics.median(r["s"] for r in rows)
        summary[arm] = {"median_step_s": median, "windows_per_s": windows / median,
                        "target_forward_share": sum(r["target_s"] for r in rows) / sum(r["s"] for r in rows),
                        "steps": rows}
    summary["speedup_shared_over_generic"] = (summary["shared_context"]["windows_per_s"]
                                              / summary["trl_generic"]["windows_per_s"])
    summary["cost_model"] = cost_model.__dict__
    return summary


def memory_peaks(args) -> dict:
    peaks = {}
    for arm in ARMS:
        command = [sys.executable, __file__, "--memory-arm", arm, "--drafter-layers", str(args.drafter_layers),
                   "--draft-vocab-size", str(args.draft_vocab_size), "--contexts", str(args.contexts),
                   "--group", str(args.group), "--max-window", str(args.max_window)]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        peaks[arm] = json.loads(output.strip().splitlines()[-1])
        print(peaks[arm], flush=True)
    return peaks


def main(argv=None):
    args = parse_args(argv)
    if args.memory_arm:
        return memory_run(args)
    threads = set_cpu_threads()
    target, tokenizer, data = setup(args)
    rollout = rollout_timings(target, tokenizer, data, args)
    print({k: round(v["windows_per_s"], 2) for k, v in rollout.items() if isinstance(v, dict)}, flush=True)
    training = training_timings(target, tokenizer, data, args)
    print({arm: round(training[arm]["windows_per_s"], 2) for arm in ARMS}, flush=True)
    memory = memory_peaks(args)
    result = {
        "command": f"python benchmarks/trainer_throughput.py --drafter-layers {args.drafter_layers} --draft-vocab-size "
                   f"{args.draft_vocab_size} --contexts {args.contexts} --group {args.group} --max-window "
                   f"{args.max_window} --repeats {args.repeats} --chunks {args.chunks} --steps-per-chunk "
                   f"{args.steps_per_chunk}",
        "precision": "fp32", "threads": threads,
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "windows_per_step": args.contexts * args.group,
        "rollout": rollout, "training": training, "memory": memory,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
