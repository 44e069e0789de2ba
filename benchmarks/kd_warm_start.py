"""KD warm start of a SmolLM2 drafter on the cheap teacher-forced top-k path, measured on held-out data.

Builds the target's top-k distributions teacher-forced over ShareGPT replies (train split order,
existing text: ~10x cheaper per token than regenerating responses on a CPU), distils a truncated
drafter with KDTrainer, and measures on target-regenerated MT-bench responses (held out): top-1
agreement (teacher forced) and greedy simulated tau on drafted windows, with the cost model.

    python benchmarks/kd_warm_start.py --out benchmarks/results/kd_warm_start.json
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoTokenizer

from ppow_trl import KDConfig, KDTrainer
from ppow_trl.serving.calibration import calibrate_policy, held_out_contexts
from ppow_trl.core.cost import calibrate_cost_model, overall_speedup
from ppow_trl.data import build_target_responses, compute_target_topk, load_mtbench, recover_json_records, sharegpt_json_path
from ppow_trl.demo import one_per_category_first
from ppow_trl.models import build_draft_vocab, draft_vocab_coverage, load_target, make_drafter
from ppow_trl.offline import smollm2_path
from ppow_trl.core.rollout import draft_windows, target_window_probs
from ppow_trl.utils import cache_root, set_cpu_threads
from ppow_trl.core.verification import greedy_accepted_length
from ppow_trl.core.windowing import AdaptiveWindowPolicy


def sharegpt_pairs(tokenizer, count, max_response_tokens):
    """(chat-template prompt ids, first reply ids) of the first `count` human->gpt ShareGPT records."""
    rows = {"prompt_ids": [], "response_ids": []}
    for record in recover_json_records(sharegpt_json_path()):
        turns = record.get("conversations", []) if isinstance(record, dict) else []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": turns[0]["value"][:2000]}],
                                               add_generation_prompt=True, return_dict=False)
        reply = tokenizer(turns[1]["value"], add_special_tokens=False)["input_ids"][:max_response_tokens]
        if len(prompt) > 384 or len(reply) < 8:
            continue
        rows["prompt_ids"].append(prompt)
        rows["response_ids"].append(reply)
        if len(rows["prompt_ids"]) >= count:
            break
    return Dataset.from_dict(rows)


@torch.no_grad()
def held_out_metrics(drafter, target, tokenizer, data, policy, vocab, cost, contexts_per_response=6):
    agree, total, contexts = 0, 0, []
    for prompt, response in zip(data["prompt_ids"], data["response_ids"]):
        ids = torch.tensor(prompt + response)[None]
        pred = drafter(ids).logits[0, len(prompt) - 1 : -1, :vocab].argmax(-1)
        agree += (pred == torch.tensor(response)).sum().item()
        total += len(response)
        for t in range(0, len(response) - 1, max(1, len(response) // contexts_per_response)):
            contexts.append(torch.tensor(prompt + response[:t]))
    pad = tokenizer.pad_token_id
    drafted = draft_windows(drafter, contexts, policy, pad_id=pad, temperature=0.0, vocab_size=vocab)
    p = target_window_probs(target, contexts, drafted.window_ids, pad_id=pad, temperature=0.0, vocab_size=vocab)
    accepted = greedy_accepted_length(drafted.window_ids, p, drafted.window_mask).float()
    lengths = drafted.window_mask.sum(-1)
    return {"top1_agreement": agree / total, "tokens": total, "windows": len(contexts),
            "greedy_simulated_tau": accepted.mean().item() + 1,
            "cost_model_speedup": overall_speedup(accepted, lengths, cost).item()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--drafter-layers", type=int, default=2)
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-window", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/kd_warm_start.json")
    args = parser.parse_args()
    threads = set_cpu_threads()
    clock = time.perf_counter()
    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)

    train = sharegpt_pairs(tokenizer, args.records, args.max_response_tokens)
    start = time.perf_counter()
    topk = compute_target_topk(target, train, top_k=32, batch_size=8, cache_dir=cache_root() / "topk")
    topk_seconds = time.perf_counter() - start
    train_tokens = sum(len(r) for r in topk["response_ids"])
    print(f"top-k over {train_tokens} tokens in {topk_seconds:.0f} s (cached runs: ~0)", flush=True)

    held = build_target_responses(target, tokenizer, one_per_category_first(load_mtbench(), 8), max_new_tokens=96,
                                  batch_size=4, cache_dir=cache_root() / "responses")
    vocab = len(tokenizer)
    draft_vocab = build_draft_vocab(train["response_ids"], args.draft_vocab_size, vocab,
                                    always_include=tokenizer.all_special_ids) if args.draft_vocab_size else None
    drafter = make_drafter(target, num_layers=args.drafter_layers, draft_vocab_ids=draft_vocab)
    policy = AdaptiveWindowPolicy(args.max_window)
    cost = calibrate_cost_model(target, drafter, args.max_window, repeats=9)
    before = held_out_metrics(drafter, target, tokenizer, held, policy, vocab, cost)
    print("before", before, flush=True)

    config = KDConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, max_steps=args.steps,
                      learning_rate=5e-4, lr_scheduler_type="cosine", warmup_steps=10, logging_steps=25,
                      report_to="none", save_strategy="no", max_length=640, disable_tqdm=True)
    trainer = KDTrainer(model=drafter.train(), args=config, train_dataset=topk, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    kd_seconds = time.perf_counter() - start
    after = held_out_metrics(trainer.model.eval(), target, tokenizer, held, policy, vocab, cost)
    # the window rule for greedy serving, from the library's one calibration on the held-out contexts
    calibrated, _ = calibrate_policy(target, trainer.model, held_out_contexts(held["prompt_ids"], held["response_ids"], 6),
                                     cost, max_window=args.max_window, regime="greedy", vocab_size=vocab,
                                     pad_id=tokenizer.pad_token_id)
    after["calibrated_policy"] = {"max_window": calibrated.max_window, "threshold": calibrated.threshold,
                                  **calibrated.calibration}
    print("after", after, flush=True)
    result = {
        "command": f"python benchmarks/kd_warm_start.py --records {args.records} --max-response-tokens "
                   f"{args.max_response_tokens} --drafter-layers {args.drafter_layers} --draft-vocab-size "
                   f"{args.draft_vocab_size} --steps {args.steps} --max-window {args.max_window}",
        "precision": "fp32", "threads": threads, "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "train_tokens": train_tokens, "topk_seconds": topk_seconds, "kd_seconds": kd_seconds,
        "draft_vocab_coverage_held_out": draft_vocab_coverage(draft_vocab, held["response_ids"]) if draft_vocab is not None else 1.0,
        "cost_model": {"drafter_cost": cost.drafter_cost, "verify_cost": cost.verify_cost},
        "held_out": "8 MT-bench first turns (one per category), target greedy responses of <= 96 tokens",
        "before": before, "after": after, "total_seconds": time.perf_counter() - clock,
        "kd_log": [h for h in trainer.state.log_history if "kd/kl" in h],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
