"""PPOWTrainer throughput on SmolLM2-135M-Instruct (fp32, CPU) with a truncated drafter.

Two measurements in one run:
1. Rollout + verification of one generation batch, with the shared-context KV cache (each context
   prefilled once for its G windows) vs without (each window re-reads its context), interleaved,
   medians: windows scored per second.
2. PPOWTrainer training steps (with KV reuse): windows per second and the share of wall time spent
   in target forwards (forward hooks on the target).

    python benchmarks/trainer_throughput.py --out benchmarks/results/trainer_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ppow_trl import PPOWConfig, PPOWTrainer
from ppow_trl.data import build_target_responses, load_mtbench
from ppow_trl.models import load_target, make_drafter
from ppow_trl.offline import smollm2_path
from ppow_trl.rollout import draft_windows, target_window_probs
from ppow_trl.utils import cache_root, set_cpu_threads
from ppow_trl.windowing import AdaptiveWindowPolicy


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--contexts", type=int, default=4, help="contexts per generation batch")
    parser.add_argument("--group", type=int, default=8, help="G windows per context")
    parser.add_argument("--max-window", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--train-steps", type=int, default=6)
    parser.add_argument("--out", default="benchmarks/results/trainer_throughput.json")
    args = parser.parse_args()
    threads = set_cpu_threads()

    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = load_mtbench().select(range(0, 80, 10))
    data = build_target_responses(target, tokenizer, prompts, max_new_tokens=96, batch_size=4,
                                  cache_dir=cache_root() / "responses")
    draft_vocab = torch.arange(args.draft_vocab_size) if args.draft_vocab_size else None
    drafter = make_drafter(target, num_layers=args.drafter_layers, draft_vocab_ids=draft_vocab)
    vocab = len(tokenizer)
    policy = AdaptiveWindowPolicy(args.max_window)
    contexts = [torch.tensor(p + r[: len(r) // 2]) for p, r in zip(data["prompt_ids"], data["response_ids"])][: args.contexts]
    pad = tokenizer.pad_token_id

    def rollout(shared: bool):
        def run():
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
        return run

    timings = {"shared_kv": [], "no_reuse": []}
    with torch.inference_mode():
        rollout(True)()
        for _ in range(args.repeats):
            for name, shared in (("shared_kv", True), ("no_reuse", False)):
                start = time.perf_counter()
                rollout(shared)()
                timings[name].append(time.perf_counter() - start)
    windows = args.contexts * args.group
    rollout_summary = {name: {"median_s": statistics.median(v), "windows_per_s": windows / statistics.median(v),
                              "all_s": v} for name, v in timings.items()}
    print({k: round(v["windows_per_s"], 2) for k, v in rollout_summary.items()}, flush=True)

    timer = ForwardTimer(target)
    train_data = data.select(range(len(data)))
    config = PPOWConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=windows, num_generations=args.group,
                        max_window=args.max_window, max_steps=args.train_steps, learning_rate=1e-5, logging_steps=1,
                        report_to="none", save_strategy="no", selection_refresh_steps=1000,
                        selection_refresh_sequences=len(train_data), disable_tqdm=True)
    trainer = PPOWTrainer(model=drafter, target_model=target, args=config, train_dataset=train_data,
                          processing_class=tokenizer)
    timer.seconds, timer.calls = 0.0, 0  # exclude start-up calibration
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    training = {
        "steps": args.train_steps, "wall_s": wall, "windows_per_s": args.train_steps * windows / wall,
        "target_forward_share": timer.seconds / wall, "target_forward_calls": timer.calls,
        "includes": "one selection refresh at step 0 (teacher-forced scoring of all sequences)",
        "cost_model": trainer.cost_model.__dict__,
    }
    print({k: v for k, v in training.items() if k != "cost_model"}, flush=True)
    result = {
        "command": f"python benchmarks/trainer_throughput.py --drafter-layers {args.drafter_layers} --draft-vocab-size "
                   f"{args.draft_vocab_size} --contexts {args.contexts} --group {args.group} --max-window "
                   f"{args.max_window} --repeats {args.repeats} --train-steps {args.train_steps}",
        "precision": "fp32", "threads": threads, "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "context_tokens": [len(c) for c in contexts], "rollout": rollout_summary, "training": training,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
