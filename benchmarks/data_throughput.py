"""Training data per CPU-second: the data routes side by side, in one run, on the main job's process shape.

Rows (every one ends with what ``KDTrainer`` reads: ``prompt_ids``, ``response_ids``, ``topk_ids``, ``topk_logprobs``):

- ``regenerate_generate``: the route before this benchmark: ``build_target_responses`` (transformers' ``generate``,
  batches of 8 prompts in file order, greedy, fp32) then ``compute_target_topk`` (a second forward over prompt +
  response).
- ``regenerate_batched``: the same greedy ``generate`` on batches of 32 length-sorted prompts, the labels read from
  its own logits (``build_target_responses(batch_size=32, label_top_k=32)``): no second pass, little padding; its
  responses are compared with the first row's (same precision, fp32). ``regenerate_batched_bf16``: the same decoded by
  a bf16 copy of the target (``precision="bf16"``, batches of ``--regeneration-batch-bf16``): the bf16 model's greedy
  text, so its agreement with the fp32 answers (identical answers, mean first differing position) is reported.
- ``teacher_forced``: the dataset's own answers labelled in one forward per sequence (``build_teacher_forced``,
  fp32), EAGLE-1's route; ``teacher_forced_bf16``: the same under bf16 autocast (CPUs with avx512_bf16 / AMX).

``trained_tokens_per_second``: response tokens labelled (every one is a KD training position) over the wall-clock of
the route, all processes together. Each route works on its own fresh cache folder, split over the launched
processes as in the main job (chunk ``i`` on rank ``i % world``).

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml benchmarks/data_throughput.py
    python benchmarks/data_throughput.py --prompts 8 --conversations 8 --out /tmp/dt.json     # a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
    import torch as _torch

    if not _torch.cuda.is_available():  # the launched processes form one gloo world only on the CPU backend
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")

import torch
import transformers
from accelerate import PartialState
from transformers import AutoTokenizer

from ppow_trl.data import (build_target_responses, build_teacher_forced, compute_target_topk,
                           load_sharegpt, load_sharegpt_conversations)
from ppow_trl.models import load_target
from ppow_trl.offline import smollm2_path
from ppow_trl.utils import cpu_summary, save_json, set_cpu_threads


def timed(state, build):
    """``build()`` between two barriers: ``(result, wall seconds of the slowest process)``."""
    state.wait_for_everyone()
    start = time.perf_counter()
    result = build()
    state.wait_for_everyone()
    return result, time.perf_counter() - start


def row(dataset, seconds: float, **extra) -> dict:
    tokens = sum(len(r) for r in dataset["response_ids"])
    prompt_tokens = sum(len(p) for p in dataset["prompt_ids"])
    return {"sequences": len(dataset), "trained_tokens": tokens, "prompt_tokens": prompt_tokens,
            "seconds": seconds, "trained_tokens_per_second": tokens / seconds, **extra}


def first_difference(reference: list[list[int]], other: list[list[int]]) -> float:
    """Mean position of the first token where two answers to the same prompt differ (the shorter length if one is
    a prefix of the other)."""
    positions = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                 for a, b in zip(reference, other)]
    return sum(positions) / max(len(positions), 1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 128: two full batches of 64, one per process (with 64, the bf16 row's single batch left one process idle)
    parser.add_argument("--prompts", type=int, default=128, help="ShareGPT train prompts regenerated (each route).")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="The main job's regenerated length.")
    parser.add_argument("--conversations", type=int, default=96, help="ShareGPT train conversations teacher-forced.")
    parser.add_argument("--max-response-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8, help="Teacher-forced sequences per forward.")
    parser.add_argument("--regeneration-batch", type=int, default=32)
    parser.add_argument("--regeneration-batch-bf16", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/data_throughput.json")
    args = parser.parse_args(argv)

    state = PartialState(cpu=not torch.cuda.is_available())
    threads = set_cpu_threads()
    target = load_target(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    prompts = load_sharegpt("train", num_samples=args.prompts, seed=1)
    conversations = load_sharegpt_conversations("train", num_samples=args.conversations, seed=2)
    chunk = max(1, args.batch_size)  # one batch per chunk: the chunks spread evenly over the processes
    rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        # every rank must name the same folders: rank 0's scratch path is broadcast
        from accelerate.utils import broadcast_object_list

        shared = broadcast_object_list([scratch])[0] if state.num_processes > 1 else scratch
        cache = lambda name: Path(shared) / name  # noqa: E731

        def two_passes():
            responses = build_target_responses(target, tokenizer, prompts, max_new_tokens=args.max_new_tokens,
                                               batch_size=8, cache_dir=cache("responses"), chunk_size=8,
                                               sort_by_length=False)
            return compute_target_topk(target, responses, top_k=32, batch_size=8, cache_dir=cache("topk"),
                                       chunk_size=8)

        before, seconds = timed(state, two_passes)
        rows["regenerate_generate"] = row(before, seconds, route="generate (batch 8, file order), then a top-k forward")

        batched, seconds = timed(state, lambda: build_target_responses(
            target, tokenizer, prompts, max_new_tokens=args.max_new_tokens, batch_size=args.regeneration_batch,
            cache_dir=cache("batched"), chunk_size=args.regeneration_batch, label_top_k=32))
        by_id = dict(zip(before["id"], before["response_ids"]))
        same = sum(by_id[i] == r for i, r in zip(batched["id"], batched["response_ids"]))
        labels = dict(zip(before["id"], before["topk_ids"]))
        top1 = [x[0] == y[0] for i, b in zip(batched["id"], batched["topk_ids"]) for x, y in zip(labels[i], b)]
        rows["regenerate_batched"] = row(batched, seconds, route=f"generate (batch {args.regeneration_batch}, "
                                         "length-sorted) with labels from its logits",
                                         responses_equal_to_regenerate_generate=f"{same}/{len(before)}",
                                         top1_label_agreement=sum(top1) / max(len(top1), 1))

        bf16_batch = args.regeneration_batch_bf16
        halved, seconds = timed(state, lambda: build_target_responses(
            target, tokenizer, prompts, max_new_tokens=args.max_new_tokens, batch_size=bf16_batch,
            cache_dir=cache("batched_bf16"), chunk_size=bf16_batch, label_top_k=32, precision="bf16"))
        same = sum(by_id[i] == r for i, r in zip(halved["id"], halved["response_ids"]))
        rows["regenerate_batched_bf16"] = row(halved, seconds, route=f"generate by a bf16 copy (batch {bf16_batch}, "
                                              "length-sorted) with labels from its logits",
                                              responses_equal_to_regenerate_generate=f"{same}/{len(before)}",
                                              mean_first_difference=first_difference(
                                                  [by_id[i] for i in halved["id"]], halved["response_ids"]))

        for name, precision in (("teacher_forced", "fp32"), ("teacher_forced_bf16", "bf16")):
            labelled, seconds = timed(state, lambda: build_teacher_forced(
                target, tokenizer, conversations, max_response_tokens=args.max_response_tokens,
                batch_size=args.batch_size, precision=precision, cache_dir=cache(name), chunk_size=chunk))
            rows[name] = row(labelled, seconds, route=f"one forward over prompt + answer ({precision})")
        fp32, bf16 = (build_teacher_forced(target, tokenizer, conversations, max_response_tokens=args.max_response_tokens,
                                           batch_size=args.batch_size, precision=p, cache_dir=cache(n), chunk_size=chunk)
                      for n, p in (("teacher_forced", "fp32"), ("teacher_forced_bf16", "bf16")))
        agree = [x[0] == y[0] for a, b in zip(fp32["topk_ids"], bf16["topk_ids"]) for x, y in zip(a, b)]
        rows["teacher_forced_bf16"]["top1_label_agreement_with_fp32"] = sum(agree) / max(len(agree), 1)
        state.wait_for_everyone()

    base = rows["regenerate_generate"]["trained_tokens_per_second"]
    for values in rows.values():
        values["vs_regenerate_generate"] = values["trained_tokens_per_second"] / base
    result = {
        "command": "accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml benchmarks/data_throughput.py"
        if state.num_processes > 1 else "python benchmarks/data_throughput.py " + " ".join(argv or sys.argv[1:]),
        "cpu": cpu_summary(), "processes": state.num_processes, "threads_per_process": threads,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "target": "SmolLM2-135M-Instruct (fp32 weights)", "regenerated_new_tokens": args.max_new_tokens,
        "teacher_forced_max_response_tokens": args.max_response_tokens, "batch_size": args.batch_size,
        "regeneration_batch": args.regeneration_batch, "regeneration_batch_bf16": args.regeneration_batch_bf16,
        "rows": rows,
    }
    if state.is_main_process:
        out = Path(args.out)
        save_json(result, out.parent, out.name)
        for name, values in rows.items():
            print(f"{name:24s} {values['trained_tokens']:7d} tokens in {values['seconds']:7.1f} s: "
                  f"{values['trained_tokens_per_second']:7.1f} trained tokens/s ({values['vs_regenerate_generate']:.2f}x)")
    return result


if __name__ == "__main__":
    main()
