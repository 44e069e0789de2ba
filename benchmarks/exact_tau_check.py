"""Exact greedy tau of one saved drafter, prompt by prompt: a deterministic fingerprint of the evaluation path.

Exact greedy tau (``ppow_trl.serving.generation.exact_greedy_tau``) is a function of the target, the drafter and the rule
only: no sampling, no timing. Running this script on two checkouts with the same drafter folder and comparing the
JSON shows whether a change moved any evaluated figure (the refactor of issue 18 was checked this way against the
commit before it). Runs on every ppow_trl version since exact_greedy_tau existed (standalone drafters folders are
loaded with ``AutoModelForCausalLM``).

    python benchmarks/exact_tau_check.py outputs/ppow-smollm2-offline/merged --num-prompts 20 \
        --out benchmarks/results/exact_tau_check.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppow_trl  # noqa: F401  (registers the reduced-vocabulary drafter)
from ppow_trl.data import encode_prompt, load_prompts, stop_token_ids
from ppow_trl.serving.generation import exact_greedy_tau, greedy_continuation
from ppow_trl.models import load_target
from ppow_trl.offline import smollm2_path
from ppow_trl.utils import set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="a saved standalone drafter folder (e.g. the main job's merged/)")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/exact_tau_check.json"))
    args = parser.parse_args(argv)
    set_cpu_threads()
    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter).eval()
    prompts = load_prompts("mtbench", num_samples=args.num_prompts, seed=0)
    eos = stop_token_ids(target, tokenizer)
    rules = {f"K={k},h=0": AdaptiveWindowPolicy(k, 0.0) for k in args.windows}
    saved = Path(args.drafter) / "ppow_window_policy.json"
    if saved.is_file():
        rules["saved"] = AdaptiveWindowPolicy.from_pretrained(args.drafter)
    records = {name: [] for name in rules}
    tokens = {name: 0 for name in rules}
    with torch.no_grad():
        for row in prompts:
            prompt = encode_prompt(tokenizer, row["messages"])
            ids = torch.tensor([prompt])
            # the target's greedy text, once per prompt (it does not depend on the drafter or the rule)
            text = greedy_continuation(target, prompt, args.max_new_tokens, len(tokenizer))
            for name, rule in rules.items():
                result = exact_greedy_tau(target, drafter, ids, policy=rule, max_new_tokens=args.max_new_tokens,
                                          eos_token_id=eos, vocab_size=len(tokenizer), continuation=text)
                records[name].append(result.accepted_per_round)
                tokens[name] += len(result.new_tokens)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # tau = tokens generated / verification forwards (bonus included), a ratio of sums over prompts
    summary = {name: {"tau": tokens[name] / max(1, sum(len(r) for r in rows)), "tokens": tokens[name],
                      "rounds": sum(len(r) for r in rows)} for name, rows in records.items()}
    result = {"command": " ".join(["python benchmarks/exact_tau_check.py", *(sys.argv[1:] if argv is None else argv)]),
              "commit": commit, "drafter": args.drafter, "precision": "fp32", "summary": summary,
              "accepted_per_round": records}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return result


if __name__ == "__main__":
    main()
