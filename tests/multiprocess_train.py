"""A few PPOWTrainer steps on tiny models, meant to be launched with several processes.

    python -m torch.distributed.run --nproc_per_node 2 tests/multiprocess_train.py OUT_DIR [MAX_STEPS] [--no-use-cpu] [--accumulate] [--evaluate]
    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml tests/multiprocess_train.py OUT_DIR

Every process builds the same tiny target, drafter, tokenizer and response dataset (deterministically,
no network), trains, and writes ``OUT_DIR/rank{i}.json`` (what its accelerator saw, the contexts it drew,
its rewards, the log history) and ``OUT_DIR/rank{i}_weights.pt`` (initial and final drafter weights).
tests/test_multiprocess.py launches it and checks the files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: the tiny-model helpers in conftest

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402

from conftest import easy_hard_bigram_table, make_bigram_llama, make_tiny_tokenizer  # noqa: E402
from ppow_trl.training.contexts import score_sequences  # noqa: E402
from ppow_trl.serving.generation import exact_greedy_tau  # noqa: E402
from ppow_trl.training.ppow_config import PPOWConfig  # noqa: E402
from ppow_trl.training.ppow_trainer import PPOWTrainer  # noqa: E402

GIVEN_COST = {"drafter_cost": 0.3, "verify_cost": [1.0, 1.4, 1.6, 1.8, 2.0]}
PROXIMITY_WEIGHT = 0.3


def response_dataset(target, seed=0, count=8, new_tokens=16):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    prompts = torch.randint(8, 64, (count, 3), generator=g)
    out = target.generate(prompts, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return Dataset.from_dict({"prompt_ids": prompts.tolist(), "response_ids": out[:, 3:].tolist()})


def noisy_drafter(table, noise=8.0, seed=1):
    return make_bigram_llama(table + noise * torch.randn(table.shape, generator=torch.Generator().manual_seed(seed)))


def flat_weights(model) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1).cpu() for _, p in sorted(model.named_parameters())])


def main() -> None:
    out_dir = sys.argv[1]
    max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    # On a machine without CUDA, use_cpu=True is what makes transformers set up gloo: without it (and without
    # ACCELERATE_USE_CPU=true in the environment) each launched process silently trains alone (world size 1).
    use_cpu = "--no-use-cpu" not in sys.argv[3:]
    # --accumulate: 2 micro-batches per optimizer step (one generation round of 16 rows per process feeds
    # both) and per-token credit, the other path through _generate_and_score_completions.
    accumulate = "--accumulate" in sys.argv[3:]
    # --evaluate: held-out responses as eval_dataset, one evaluation at the last step (exact greedy tau sharded over
    # the processes, window calibration on the main process and broadcast).
    evaluate = "--evaluate" in sys.argv[3:]
    # --measure-cost: no given cost ratios: the main process measures the cost model and broadcasts it.
    measure_cost = "--measure-cost" in sys.argv[3:]
    os.makedirs(out_dir, exist_ok=True)

    table = easy_hard_bigram_table()
    target = make_bigram_llama(table)
    dataset = response_dataset(target)
    drafter = noisy_drafter(table)
    initial = flat_weights(drafter)
    args = PPOWConfig(
        output_dir=os.path.join(out_dir, "trainer"), per_device_train_batch_size=8, num_generations=4, max_window=4,
        max_steps=max_steps, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, selection_refresh_steps=2, selection_refresh_sequences=4, seed=0,
        proximity_weight=PROXIMITY_WEIGHT, use_cpu=use_cpu, **({} if measure_cost else GIVEN_COST),
        **(dict(gradient_accumulation_steps=2, per_token_credit=True) if accumulate else {}),
        **(dict(eval_strategy="steps", eval_steps=max_steps, eval_max_new_tokens=8,
                calibration_contexts_per_response=2) if evaluate else {}),
    )
    held_out = response_dataset(target, seed=5, count=5) if evaluate else None
    trainer = PPOWTrainer(model=drafter, target_model=target, args=args, train_dataset=dataset, eval_dataset=held_out,
                          processing_class=make_tiny_tokenizer())

    # Record, per generation round, the global draw, this process's slice and its rewards.
    steps: list[dict] = []
    draw, select, rollout = trainer.context_selector.draw, trainer._select_contexts, trainer._rollout

    def recording_draw(round_index, count):
        chosen = draw(round_index, count)
        steps.append({"round": round_index, "global_draw": chosen.tolist()})
        return chosen

    def recording_select(inputs):
        rows = select(inputs)
        steps[-1]["candidates"] = [row["candidate"] for row in rows]
        steps[-1]["prompts"] = [list(row["prompt"]) for row in rows]
        return rows

    def recording_rollout(prompts, trainer=None):
        result = rollout(prompts, trainer)
        w = trainer_ref.last_window_rewards
        steps[-1].update(
            rollout_prompts=[list(p) for p in prompts],
            speed=w["speed"].tolist(), proximity=w["proximity"].tolist(), accepted=w["accepted"].tolist(),
            lengths=w["lengths"].tolist(), window_ids=w["window_ids"].tolist(),
        )
        return result

    trainer_ref = trainer
    trainer.context_selector.draw = recording_draw
    trainer._select_contexts = recording_select
    trainer.rollout_func = recording_rollout
    refreshes, refreshed_scores = [], []
    refresh = trainer._refresh_selection_scores

    def recording_refresh():
        # Which sequences this refresh covers (each process scores its share; the scores are gathered).
        selector, pool = trainer.context_selector, trainer.context_pool
        count = min(args.selection_refresh_sequences, len(pool.responses))
        first = (selector.refresh_count * count) % len(pool.responses)
        sequences = [(first + i) % len(pool.responses) for i in range(count)]
        refresh()
        refreshes.append(trainer.context_selector.probabilities().tolist())
        # All of them, scored here in one process: the gathered scores must land on the same candidates.
        rows = score_sequences(trainer.target, trainer._unwrapped_drafter(), [pool.sequence_ids(s) for s in sequences],
                               [len(pool.prompts[s]) for s in sequences], vocab_size=trainer.vocab_size,
                               target_temperature=trainer._verify_temperature, drafter_temperature=args.temperature,
                               kind=args.selection_divergence)
        candidates = pool.candidates_of(sequences)
        refreshed_scores.append({
            "num_scored": int(selector.scored.sum()),
            "max_difference": float((selector.scores[candidates] - torch.cat(rows).cpu()).abs().max()),
            "all_scored": bool(selector.scored[candidates].all()),
        })

    trainer._refresh_selection_scores = recording_refresh

    trainer.train()

    acc = trainer.accelerator
    final = flat_weights(trainer._unwrapped_drafter())
    evaluation = None
    if evaluate:
        # exact greedy tau over all held-out prompts in this one process, at the rule the evaluation used
        tokens = rounds = 0
        for prompt in held_out["prompt_ids"]:
            result = exact_greedy_tau(trainer.target, trainer._unwrapped_drafter(), torch.tensor([prompt]),
                                      policy=trainer.window_policy, max_new_tokens=8, vocab_size=trainer.vocab_size)
            tokens, rounds = tokens + len(result.new_tokens), rounds + result.num_rounds
        evaluation = {"logged": [h for h in trainer.state.log_history if "eval_tau" in h],
                      "policy": [trainer.window_policy.max_window, trainer.window_policy.threshold],
                      "local_tau": tokens / rounds}
    # Files are named by the launcher's RANK, so a process that wrongly believes it is alone does not
    # overwrite the others' report.
    rank = int(os.environ.get("RANK", acc.process_index))
    torch.save({"initial": initial, "final": final}, os.path.join(out_dir, f"rank{rank}_weights.pt"))
    report = {
        "world_size": acc.num_processes,
        "process_index": rank,
        "env_rank": os.environ.get("RANK"),
        "env_world_size": os.environ.get("WORLD_SIZE"),
        "distributed_type": str(acc.distributed_type),
        "backend": getattr(acc.state, "backend", None),
        "wrapped_model": type(trainer.model_wrapped).__name__,
        "num_generations": trainer.num_generations,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "steps_per_generation": args.steps_per_generation,
        "proximity_weight": PROXIMITY_WEIGHT,
        "initial_checksum": float(initial.double().sum()),
        "final_checksum": float(final.double().sum()),
        "global_step": trainer.state.global_step,
        "steps": steps,
        "selection_probabilities": refreshes,
        "refreshed_scores": refreshed_scores,
        "log_history": trainer.state.log_history,
        "evaluation": evaluation,
        "cost_model": dataclasses.asdict(trainer.cost_model),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    acc.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a clean exit: no gloo threads left at interpreter shutdown


if __name__ == "__main__":
    main()
