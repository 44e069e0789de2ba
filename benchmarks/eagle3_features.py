"""EAGLE-3 KD: cached target features vs features recomputed per batch, time per trained token (SmolLM2, fp32 CPU).

    python benchmarks/eagle3_features.py [--steps 4] [--output benchmarks/results/eagle3_features.json]

Both arms run the same KDTrainer optimizer steps (batch 8, 3-step training-time test, 8,192-token head) on the
study's training responses; "cached" reads `compute_target_features`' float16 columns (built once, the time printed
separately, like the KD teacher's top-k), "on the fly" runs one no-grad target forward per batch. Steps alternate
between the arms (one at a time, so machine load hits both alike); medians of per-step seconds, per response token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/eagle3_features.json"))
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from ppow_trl.drafters.eagle3 import Eagle3DrafterForCausalLM
    from ppow_trl.training.kd_trainer import DataCollatorForKD, KDConfig, KDTrainer
    from ppow_trl.models import build_draft_vocab, load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.study.data import StudyData, train_features, train_responses, train_topk
    from ppow_trl.utils import set_cpu_threads

    threads = set_cpu_threads()
    target = load_target(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    spec = StudyData()
    train, _ = train_responses(target, tokenizer, spec)
    topk = train_topk(target, train, spec)
    vocab = build_draft_vocab(train["response_ids"], 8192, len(tokenizer), always_include=tokenizer.all_special_ids)
    head = Eagle3DrafterForCausalLM.from_target(target, draft_vocab_ids=vocab).train()
    start = time.perf_counter()
    cached = train_features(target, topk, head.config.target_layer_ids, spec)
    load_seconds = time.perf_counter() - start

    config = KDConfig(output_dir="/tmp/eagle3-features-bench", report_to="none", use_cpu=True, ttt_steps=3,
                      per_device_train_batch_size=8, max_length=640, disable_tqdm=True)
    trainers = {"cached": KDTrainer(head, config, train_dataset=cached, processing_class=tokenizer),
                "on_the_fly": KDTrainer(head, config, train_dataset=topk, processing_class=tokenizer, target=target)}
    collator = DataCollatorForKD(pad_token_id=tokenizer.pad_token_id, max_length=640)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-5)
    seconds = {name: [] for name in trainers}
    tokens = []
    for step in range(args.steps):
        rows = list(range(8 * step, 8 * step + 8))
        for name, trainer in trainers.items():
            dataset = cached if name == "cached" else topk
            begin = time.perf_counter()
            batch = collator([dataset[i] for i in rows])
            loss = trainer.compute_loss(head, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds[name].append(time.perf_counter() - begin)
        tokens.append(int(batch["completion_mask"].sum()))
    per_token = {name: statistics.median(s[i] / tokens[i] for i in range(len(tokens))) for name, s in seconds.items()}
    result = {
        "command": " ".join(["python benchmarks/eagle3_features.py", *(sys.argv[1:] if argv is None else argv)]),
        "precision": "fp32", "threads": threads, "steps_per_arm": args.steps, "batch_size": 8, "ttt_steps": 3,
        "median_step_seconds": {name: statistics.median(s) for name, s in seconds.items()},
        "median_seconds_per_trained_token": per_token,
        "ratio_on_the_fly_to_cached": per_token["on_the_fly"] / per_token["cached"],
        "response_tokens_per_batch": tokens,
        "feature_cache_load_or_build_seconds": load_seconds,
        "feature_cache_mib": round(sum(len(p) + len(r) for p, r in zip(train["prompt_ids"], train["response_ids"]))
                                   * len(head.config.target_layer_ids) * head.config.target_hidden_size * 2 / 2**20),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
