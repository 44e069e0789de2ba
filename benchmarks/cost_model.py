"""Cost model of SmolLM2-135M-Instruct (fp32, CPU) with truncated drafters, full vs reduced head.

For each drafter (first N target layers; full 49,152-token head or an N-token draft head) it runs
`ppow_trl.calibrate_cost_model` (round-robin timing, medians after warm-up) on the same context and
writes the ratios t_d/t_t and t_v(L)/t_t to JSON, with the break-even accepted length of a fixed
window K: the E[A] at which S(y) = 1, i.e. E[A] = K t_d + t_v(K) - 1.

    python benchmarks/cost_model.py --out benchmarks/results/cost_model.json
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ppow_trl.core.cost import calibrate_cost_model
from ppow_trl.data import load_mtbench
from ppow_trl.models import load_target, make_drafter
from ppow_trl.offline import smollm2_path
from ppow_trl.utils import set_cpu_threads


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--max-window", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default="benchmarks/results/cost_model.json")
    args = parser.parse_args()
    threads = set_cpu_threads()

    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    messages = load_mtbench()[0]["messages"]
    context = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    # The most frequent ids are irrelevant to timing: any N ids cost the same.
    draft_vocab = torch.arange(args.draft_vocab_size)
    rows = []
    for layers in args.layers:
        for head in ("full", "reduced"):
            drafter = make_drafter(target, num_layers=layers, draft_vocab_ids=draft_vocab if head == "reduced" else None)
            cost = calibrate_cost_model(target, drafter, args.max_window, context_ids=context, repeats=args.repeats)
            k = args.max_window
            rows.append({
                "drafter_layers": layers,
                "head": head if head == "full" else f"reduced {args.draft_vocab_size}",
                "drafter_cost": cost.drafter_cost,
                "verify_cost": cost.verify_cost,
                "break_even_accepted_at_K": k * cost.drafter_cost + cost.verify_cost[k] - 1,
                "target_step_ms": 1e3 * cost.raw_seconds["target_step"],
                "drafter_step_ms": 1e3 * cost.raw_seconds["drafter_step"],
            })
            print(f"layers {layers} head {rows[-1]['head']:>14s}: t_d/t_t {cost.drafter_cost:.3f} "
                  f"(drafter {rows[-1]['drafter_step_ms']:.1f} ms, target {rows[-1]['target_step_ms']:.1f} ms), "
                  f"t_v(L)/t_t " + " ".join(f"{c:.2f}" for c in cost.verify_cost)
                  + f", break-even E[A] at K={k}: {rows[-1]['break_even_accepted_at_K']:.2f}", flush=True)
            del drafter
    result = {
        "command": "python benchmarks/cost_model.py --layers " + " ".join(map(str, args.layers)) + f" --draft-vocab-size {args.draft_vocab_size} --max-window {args.max_window} --repeats {args.repeats}",
        "precision": "fp32", "threads": threads, "context_tokens": context.shape[1],
        "machine": {"platform": platform.platform(), "torch": torch.__version__},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
