"""Served rounds against the cost model: what a round of L drafted tokens costs in the serving loop, by L.

The served rule and the guard charge a round ``CostModel.round_time(L)`` plain steps. This script calibrates a
drafter's rule on the compiled runtime as ``calibrate_for_serving`` does (forwards timed alone, plus the loop's host
work from ``measure_loop_overhead``; the best rule is timed even where it would not be served), then serves MT-bench
prompts three ways, in turn prompt by prompt: plain decoding (K = 0), the rule without its online guard (every round
drafts: the steady state the cost model describes) and the rule as served (guarded: drafting resumes after pauses).
Every round is timed (``SpeculativeOutput.round_seconds``). It writes, per drafted length ``L`` and arm: the rounds'
median time over the median plain round, their count and mean accepted length; the cost model's round time; the
calibration contexts' window lengths (the mix the rule was chosen on); and, guarded, the drafting rounds that follow
a paused one (the drafter reads the paused stretch, and both models' weights have gone cold in the CPU's cache).

    python benchmarks/round_costs.py outputs/ppow-smollm2-offline/merged --precision int8 \\
        --out benchmarks/results/round_costs_xeon_amx_int8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
CALIBRATION_PROMPTS = 16  # as benchmarks/compiled_serving.py
MAX_CACHE_LEN = 512


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafter", help="a saved drafter folder (e.g. the main job's merged/)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "int8"], default="int8",
                        help="the target's (and the drafter's) serving precision")
    parser.add_argument("--prompts", type=int, default=8, help="MT-bench prompts, in the set's order")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-window", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "round_costs.json")
    args = parser.parse_args(argv)

    import ppow_trl  # noqa: F401
    from ppow_trl.data import build_target_responses, encode_prompt, load_prompts, stop_token_ids
    from ppow_trl.drafting import load_drafter
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.serving.calibration import held_out_contexts
    from ppow_trl.serving.generation import speculative_generate
    from ppow_trl.compiled_runtime.precision import serving_precision
    from ppow_trl.serving.rule import calibrate_for_serving
    from ppow_trl.serving.runtime import serving_runtime
    from ppow_trl.core.windowing import AdaptiveWindowPolicy
    from ppow_trl.utils import cache_root, set_cpu_threads

    sys.path.insert(0, str(REPO))
    from benchmarks.llama_cpp_amx_build import cpu_description

    set_cpu_threads(1)
    target = load_target(smollm2_path()).eval()
    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    stop_ids = stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    drafter = load_drafter(args.drafter, target=target).eval()
    calibration = build_target_responses(target, tokenizer, load_prompts("sharegpt-test", CALIBRATION_PROMPTS, seed=1),
                                         max_new_tokens=64, batch_size=8, seed=1,
                                         cache_dir=cache_root() / "responses")
    contexts = held_out_contexts(calibration["prompt_ids"], calibration["response_ids"], 4, 64)
    served_target = target if args.precision == "fp32" else serving_precision(target, args.precision)
    runtime = serving_runtime(served_target, drafter, runtime="compiled", max_window=args.max_window,
                              max_cache_len=MAX_CACHE_LEN, precision=args.precision, drafter_precision=args.precision)
    if runtime.name != "compiled":
        raise SystemExit(f"The compiled runtime is unavailable here ({runtime.fallback}).")
    with torch.no_grad():
        policy, cost_model, report = calibrate_for_serving(served_target, drafter, contexts,
                                                           max_window=args.max_window, vocab_size=len(tokenizer),
                                                           pad_id=pad_id, runtime=runtime, min_speedup=1.0)
    best = policy
    if policy.max_window == 0 and policy.calibration.get("best_speculative_rule"):
        rule = policy.calibration["best_speculative_rule"]  # time the rounds of the best rule even when not served
        best = policy.with_window(rule["max_window"], rule["threshold"], rule.get("empty_windows", False))
        best.guard = rule.get("guard")
    print(f"rule: {policy.calibration['serving_rule']}", file=sys.stderr, flush=True)

    # The rule unguarded (every round drafts: the steady state the cost model describes) and guarded (as served:
    # drafting resumes after pauses, with the drafter reading the paused stretch and both models' weights cold).
    unguarded = best.with_window(best.max_window, best.threshold)
    unguarded.guard = None
    arms = {"plain": AdaptiveWindowPolicy(max_window=0), "unguarded": unguarded, "guarded": best}
    times = {name: defaultdict(list) for name in arms}  # (arm, L) -> round seconds
    accepted = {name: defaultdict(list) for name in arms}
    after_pause = defaultdict(list)  # guarded: drafting rounds right after a round that drafted nothing
    prompts = [torch.tensor([encode_prompt(tokenizer, row["messages"])])
               for row in load_prompts("mtbench", num_samples=args.prompts)]
    with torch.no_grad():
        for ids in prompts:
            for name, rule in arms.items():  # in turn, prompt by prompt: the machine's drift weighs on each alike
                for repeat in range(2):  # the first run warms the caches, the second is timed
                    out = speculative_generate(runtime.target, runtime.drafter, ids, policy=rule,
                                               max_new_tokens=args.max_new_tokens, eos_token_id=stop_ids,
                                               vocab_size=len(tokenizer))
                    if repeat == 0:
                        continue
                    rounds = list(zip(out.drafted_per_round, out.accepted_per_round, out.round_seconds))
                    for index in range(1, len(rounds)):  # the first round reads the prompt: left out
                        length, accept, seconds = rounds[index]
                        times[name][length].append(seconds)
                        accepted[name][length].append(accept)
                        if name == "guarded" and length and not rounds[index - 1][0]:
                            after_pause[length].append(seconds)
    plain = statistics.median(times["plain"][0])
    lengths = [int(n) for n in best.window_lengths(report["confidences"]).tolist()] if best.max_window else []

    def by_length(name):
        return {str(length): {"round_time_median": round(statistics.median(values) / plain, 4),
                              "rounds": len(values), "mean_accepted": round(statistics.mean(accepted[name][length]), 4)}
                for length, values in sorted(times[name].items())}

    result = {
        "cpu": cpu_description(), "torch": torch.__version__, "threads": 1, "precision": args.precision,
        "runtime": runtime.describe(), "drafter": str(args.drafter), "prompts": f"MT-bench, first {args.prompts}",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
        "served_rule": policy.calibration["serving_rule"],
        "timed_rule": {"max_window": best.max_window, "threshold": best.threshold},
        "plain_round_ms": round(1000 * plain, 3),
        "cost_model_round_time": {str(length): round(float(cost_model.round_time(torch.tensor([length]))[0]), 4)
                                  for length in range(best.max_window + 1)},
        "calibration_windows": {str(length): lengths.count(length) for length in sorted(set(lengths))},
        "unguarded": by_length("unguarded"),
        "guarded": by_length("guarded"),
        "guarded_after_a_pause": {str(length): {"round_time_median": round(statistics.median(values) / plain, 4),
                                                "rounds": len(values)} for length, values in sorted(after_pause.items())},
        "tau": {name: round(_tau(times[name], accepted[name]), 4) for name in arms},
        "loop_overhead": cost_model.raw_seconds.get("loop_overhead"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({key: result[key] for key in ("cost_model_round_time", "unguarded", "guarded",
                                                    "guarded_after_a_pause", "tau")}, indent=1))
    return result


def _tau(times: dict, accepted: dict) -> float:
    """Tokens per round over the timed rounds (``A + 1`` each)."""
    rounds = sum(len(values) for values in times.values())
    return sum(a + 1 for values in accepted.values() for a in values) / max(rounds, 1)


if __name__ == "__main__":
    main()
