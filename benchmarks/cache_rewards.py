"""Greedy PPOW rewards from the cached text against the target-verified ones: agreement and training throughput.

    python benchmarks/cache_rewards.py [--drafter outputs/study_converged/truncated_converged]

On the study's data (SmolLM2-135M-Instruct fp32, its greedy responses to ShareGPT prompts):

1. Agreement. Windows drafted after ``--contexts`` training contexts (G = 8 each, T = 1, the study's rollout rule),
   verified both ways on the same windows: the share of windows whose rewards (A, R_speed, R_prox over the reached
   positions) differ, and of reached positions where the cached token is not the verifying target's argmax. Also
   the share of response tokens that batch-1 teacher forcing would not have produced (fp32 near-ties between the
   batched generation that wrote the text and a single-sequence forward).
2. Throughput. Two PPOWTrainers (``reward_source="target"`` and ``"cache"``, the study's PPOW settings, greedy
   acceptance) trained in alternating blocks of ``--block`` optimizer steps: median step time, steps/s and window
   tokens/s of each, and their ratio, measured side by side in one run.

Writes ``benchmarks/results/cache_rewards.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from ppow_trl.training.cached_verification import cached_next_tokens, verify_windows_from_cache
from ppow_trl.training.contexts import ContextPool
from ppow_trl.core.cost import CostModel
from ppow_trl.core.rollout import verify_windows, window_rewards
from ppow_trl.study.arms import ARMS
from ppow_trl.study.runner import StudyConfig, _build_drafter, _load, _load_drafter
from ppow_trl.utils import set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy


class StepTimes(TrainerCallback):
    def __init__(self):
        self.seconds, self._start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


def agreement(target, drafter, pool: ContextPool, policy, cost, tokenizer, contexts: int, seed: int) -> dict:
    vocab, pad = len(tokenizer), tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(seed)
    candidates = torch.randint(len(pool), (contexts,), generator=generator)
    windows = differing = reached = reached_mismatch = target_rows = 0
    for first in range(0, contexts, 4):
        batch = candidates[first:first + 4]
        sequences, starts = pool.locate(batch)
        ctx = [torch.tensor(pool.context(int(c))) for c in batch]
        nexts = cached_next_tokens([pool.responses[s] for s in sequences], starts, policy.max_window + 1)
        a = verify_windows(target, drafter, ctx, policy, greedy=True, temperature=1.0, pad_id=pad, vocab_size=vocab,
                           generator=torch.Generator().manual_seed(first), num_samples_per_context=8)
        b, rows = verify_windows_from_cache(drafter, ctx, nexts, policy, target=target, temperature=1.0, pad_id=pad,
                                            vocab_size=vocab, generator=torch.Generator().manual_seed(first),
                                            num_samples_per_context=8)
        ra = window_rewards(a, cost, proximity_positions="reached")
        rb = window_rewards(b, cost, proximity_positions="reached")
        same = (ra["accepted"] == rb["accepted"]) & torch.isclose(ra["speed"], rb["speed"]) & torch.isclose(
            ra["proximity"], rb["proximity"])
        windows += len(same)
        differing += int((~same).sum())
        target_rows += rows
        mask = torch.cat([torch.ones_like(a.prefix[:, :1]), a.prefix[:, :-1]], -1).bool() & a.drafted.window_mask
        argmax = a.target_probs[:, :-1].argmax(-1)
        cached = nexts.repeat_interleave(8, 0)[:, : argmax.shape[1]]
        known = mask & (cached >= 0)
        reached += int(known.sum())
        reached_mismatch += int(((argmax != cached) & known).sum())
    return {"contexts": contexts, "windows": windows, "windows_with_different_rewards": differing,
            "reached_positions": reached, "reached_positions_cached_token_not_target_argmax": reached_mismatch,
            "windows_verified_by_target_in_cache_mode": target_rows}


@torch.no_grad()
def teacher_forcing_mismatch(target, pool: ContextPool, sequences: int) -> dict:
    """Response tokens that are not the argmax of a batch-1 teacher-forced target forward over prompt + response."""
    tokens = mismatched = 0
    for s in range(min(sequences, len(pool.responses))):
        ids = pool.sequence_ids(s)
        prompt = len(pool.prompts[s])
        logits = target(input_ids=ids[None]).logits[0, prompt - 1:-1]
        tokens += len(ids) - prompt
        mismatched += int((logits.argmax(-1) != ids[prompt:]).sum())
    return {"sequences": min(sequences, len(pool.responses)), "response_tokens": tokens,
            "not_batch1_argmax": mismatched}


def throughput(target, tokenizer, train, drafter_source, cost: CostModel, config: StudyConfig, blocks: int,
               block: int) -> dict:
    import copy

    from peft import LoraConfig

    from ppow_trl import PPOWConfig, PPOWTrainer
    from ppow_trl.drafting import family_of

    trainers, timers, tokens = {}, {}, {}
    for source in ("target", "cache"):
        drafter = copy.deepcopy(drafter_source).train()
        args = PPOWConfig(output_dir=f"/tmp/cache_rewards_{source}", max_window=config.max_window,
                          window_threshold=config.window_threshold, num_generations=config.num_generations,
                          per_device_train_batch_size=config.ppow_contexts_per_step * config.num_generations,
                          learning_rate=config.ppow_learning_rate, lr_scheduler_type="constant", max_steps=block,
                          logging_steps=block, save_strategy="no", report_to="none", eval_strategy="no",
                          selection_refresh_steps=20, selection_refresh_sequences=32, seed=0, disable_tqdm=True,
                          use_cpu=True, calibrate_window=False, acceptance="greedy", reward_source=source,
                          drafter_cost=cost.drafter_cost, verify_cost=list(cost.verify_cost)[: config.max_window + 1])
        lora = LoraConfig(r=config.lora_r, lora_alpha=2 * config.lora_r, task_type=family_of(drafter).peft_task_type,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        timers[source] = StepTimes()
        trainers[source] = PPOWTrainer(model=drafter, target_model=target, args=args, train_dataset=train,
                                       processing_class=tokenizer, peft_config=lora, callbacks=[timers[source]])
        tokens[source] = 0
    for _ in range(blocks):  # alternating blocks: the machine's drift hits both alike
        for source, trainer in trainers.items():
            before = trainer.trained_window_tokens
            trainer.train()
            tokens[source] += trainer.trained_window_tokens - before
    out = {}
    for source, timer in timers.items():
        total = sum(timer.seconds)
        out[source] = {"steps": len(timer.seconds), "median_step_seconds": statistics.median(timer.seconds),
                       "steps_per_second": len(timer.seconds) / total, "window_tokens": tokens[source],
                       "window_tokens_per_second": tokens[source] / total}
    out["ratio_steps_per_second"] = out["cache"]["steps_per_second"] / out["target"]["steps_per_second"]
    out["ratio_median_step"] = out["target"]["median_step_seconds"] / out["cache"]["median_step_seconds"]
    out["ratio_window_tokens_per_second"] = (out["cache"]["window_tokens_per_second"]
                                             / out["target"]["window_tokens_per_second"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=Path, default=Path("outputs/study_converged/truncated_converged"),
                        help="a saved drafter (default: the converged study's truncated drafter; a fresh one if absent)")
    parser.add_argument("--contexts", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/cache_rewards.json"))
    args = parser.parse_args()
    threads = set_cpu_threads()
    config = StudyConfig()
    target, tokenizer, train, _, _, draft_vocab = _load(config)
    if (args.drafter / "config.json").is_file():
        drafter, source = _load_drafter(args.drafter, target), str(args.drafter)
    else:
        drafter, source = _build_drafter(ARMS["kd"], config, target, tokenizer, draft_vocab).eval(), "fresh truncated"
    from ppow_trl.serving.assisted import load_cost_model

    cost = load_cost_model(args.drafter) if (args.drafter / "config.json").is_file() else None
    cost = cost or CostModel(0.12, [1.0, 1.69, 2.06, 1.53, 1.78, 2.0, 2.2])
    pool = ContextPool(train)
    policy = AdaptiveWindowPolicy(config.max_window, config.window_threshold)
    clock = time.perf_counter()
    result = {
        "command": "python benchmarks/cache_rewards.py " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items() if k != "output"),
        "drafter": source, "precision": "fp32", "threads": threads, "platform": platform.platform(),
        "agreement": agreement(target, drafter, pool, policy, cost, tokenizer, args.contexts, seed=0),
        "teacher_forcing": teacher_forcing_mismatch(target, pool, args.sequences),
    }
    result["agreement_seconds"] = time.perf_counter() - clock
    result["throughput"] = throughput(target, tokenizer, train, drafter, cost, config, args.blocks, args.block)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
