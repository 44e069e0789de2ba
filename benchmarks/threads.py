"""Which torch thread setting to use on this machine: 1 vs 2 (vs N) threads, interleaved.

Times a 1-token cached decode step and a 9-token verification forward of SmolLM2-135M (fp32) and a
tiny model forward, alternating thread settings round by round so that machine load hits all
settings alike. Writes medians and spreads to JSON.

    python benchmarks/threads.py --out benchmarks/results/threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from ppow_trl.offline import smollm2_path
from ppow_trl.utils import crop_cache


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/threads.json")
    args = parser.parse_args()

    target = AutoModelForCausalLM.from_pretrained(smollm2_path()).eval()
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2)).eval()
    context = torch.randint(0, 49152, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = target(context, use_cache=True).cache

    def step(num_tokens):
        def run():
            target(context[:, :num_tokens], cache=cache, use_cache=True)
            crop_cache(cache, 128)
        return run

    def tiny_forward():
        tiny(torch.randint(0, 64, (1, 16)))

    workloads = {"target_decode_1_token": step(1), "target_verify_9_tokens": step(9), "tiny_forward_16_tokens": tiny_forward}
    samples = {f"{name}@{n}": [] for name in workloads for n in args.threads}
    with torch.inference_mode():
        for n in args.threads:  # warm-up
            torch.set_num_threads(n)
            for fn in workloads.values():
                fn()
        for _ in range(args.rounds):
            for n in args.threads:
                torch.set_num_threads(n)
                for name, fn in workloads.items():
                    samples[f"{name}@{n}"].append(timed(fn))
    summary = {
        key: {"median_ms": 1e3 * statistics.median(v), "p10_ms": 1e3 * sorted(v)[len(v) // 10],
              "p90_ms": 1e3 * sorted(v)[(9 * len(v)) // 10], "max_ms": 1e3 * max(v)}
        for key, v in samples.items()
    }
    result = {
        "command": "python benchmarks/threads.py --threads " + " ".join(map(str, args.threads)) + f" --rounds {args.rounds} --out {args.out}",
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "precision": "fp32",
        "rounds": args.rounds,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for key, row in summary.items():
        print(f"{key:32s} median {row['median_ms']:8.2f} ms  p10 {row['p10_ms']:8.2f}  p90 {row['p90_ms']:8.2f}  max {row['max_ms']:8.2f}")


if __name__ == "__main__":
    main()
