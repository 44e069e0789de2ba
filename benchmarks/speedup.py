"""Greedy speedup of the shipped drafters against the target alone, as users serve them (fp32, CPU, batch 1).

For each drafter folder (the main job's `outputs/ppow-smollm2-offline/merged` by default, and the long recipe's
when it exists) and each prompt set (80 MT-bench questions; code completion from `more-itertools`, which nothing
here trains or tunes on), `ppow_trl.bench.run_benchmark` times, interleaved prompt by prompt:

- `target`: `target.generate` alone (the baseline of every ratio);
- `fast_plain`: our loop with K = 0, against `generate` (what a drafter served with K = 0 runs);
- `fast_adaptive[served]` and `hook[served]`: the drafter at the rule saved with it (`calibrate_for_serving`: K = 0
  when the measured costs predict no gain of at least 5%, else (K, h) with the online guard), our loop and HF's assisted loop;
- `fast_adaptive[speculative]` / `[speculative_unguarded]`: the best rule that speculates, with and without the
  guard (`calibration.best_speculative_rule`): what the guard buys where speculation does not pay.

Per row: median speedup with a bootstrap interval over prompts (of the per-prompt ratio), tau, lossless count, the
round's decomposition (ms in target forwards, drafter forwards and outside the models), and the machine's cost
model measured on the drafter as served. Results are written after each (drafter, prompt set), and a rerun skips
the pairs already in the JSON (`--force` recomputes).

    python benchmarks/speedup.py                                   # ~50 min on one core
    python benchmarks/speedup.py --num-prompts 4 --code-prompts 2 --out /tmp/speedup.json   # a smoke run
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import random
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ppow_trl  # noqa: F401  (registers the reduced-vocabulary drafter)
from ppow_trl.bench import BenchDrafter, run_benchmark
from ppow_trl.bench.report import machine_info
from ppow_trl.core.cost import CostModel
from ppow_trl.data import load_prompts
from ppow_trl.models import load_target
from ppow_trl.offline import smollm2_path
from ppow_trl.serving.rule import describe_serving_rule
from ppow_trl.utils import set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy

DEFAULT_DRAFTERS = {"main_job": "outputs/ppow-smollm2-offline/merged", "long": "outputs/ppow-smollm2-long/merged"}


def bootstrap_median(values, num_resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile interval of the median of ``values``, resampling prompts with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(num_resamples))
    return [medians[int(0.025 * num_resamples)], medians[int(0.975 * num_resamples) - 1]]


def variants(folder: Path) -> list[BenchDrafter]:
    """The served drafter and, when the saved calibration names one, the best speculative rule with and without
    its guard (the same weights)."""
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    policy = AdaptiveWindowPolicy.from_pretrained(folder)
    cost = CostModel.from_pretrained(folder)
    out = [BenchDrafter("served", model, policy, cost, source=str(folder))]
    alternative = (policy.calibration or {}).get("best_speculative_rule")
    if alternative and policy.max_window == 0:
        guarded = policy.with_window(alternative["max_window"], alternative["threshold"])
        guarded.guard = alternative["guard"]
        out.append(BenchDrafter("speculative", copy.deepcopy(model), guarded, cost, source=str(folder)))
        unguarded = policy.with_window(alternative["max_window"], alternative["threshold"])
        unguarded.guard = None
        out.append(BenchDrafter("speculative_unguarded", copy.deepcopy(model), unguarded, cost, source=str(folder)))
    elif policy.guard:
        unguarded = policy.with_window(policy.max_window, policy.threshold)
        unguarded.guard = None
        out.append(BenchDrafter("served_unguarded", copy.deepcopy(model), unguarded, cost, source=str(folder)))
    return out


def summarize(report: dict) -> list[dict]:
    rows = []
    for row in report["summary"]:
        ratios = [r["speedup"] for r in report["records"] if r["label"] == row["label"]]
        entry = {key: row.get(key) for key in ("label", "method", "drafter", "tau", "speedup_median", "speedup_p25",
                                                "speedup_p75", "lossless_prompts", "ms_per_round", "outside_share",
                                                "drafter_seconds_per_forward", "mean_window_length",
                                                "mean_accepted")}
        entry["speedup_median_ci95"] = bootstrap_median(ratios)
        guard = [r.get("guard_decisions") for r in report["records"] if r["label"] == row["label"]]
        if any(g is not None for g in guard):
            flat = [d for g in guard if g for d in g]
            entry["guard_plain_round_share"] = 1 - sum(flat) / max(len(flat), 1)
        rows.append(entry)
    return rows


def markdown(results: dict) -> str:
    """One table per (drafter, prompt set): the rows of the JSON, for docs/benchmarks.md."""
    lines = []
    for key, run in results["runs"].items():
        costs = run["cost_model"]
        lines += [f"**{key}** ({run['num_prompts']} prompts, {run['max_new_tokens']} new tokens, greedy, {run['precision']}, "
                  f"{run['threads']} thread, {run['date']}). Served rule: {run['served_rule']}", "",
                  "| route | tau | speedup, median [95% CI] | lossless | ms/round: target / drafter / outside | "
                  "outside share | plain rounds (guard) |", "|---|---|---|---|---|---|---|"]
        for row in run["rows"]:
            ms = row.get("ms_per_round") or {}
            ci = row["speedup_median_ci95"]
            plain = row.get("guard_plain_round_share")
            lines.append(f"| {row['label']} | {row['tau']:.3f} | {row['speedup_median']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] | "
                         f"{row['lossless_prompts']} | {ms.get('target', 0):.1f} / {ms.get('drafter', 0):.1f} / "
                         f"{ms.get('outside', 0):.1f} | {row.get('outside_share') or 0:.3f} | "
                         + ("-" if plain is None else f"{plain:.2f}") + " |")
        lines += ["", f"t_d/t_t = {costs['drafter_cost']:.3f}, t_v(L)/t_t (L = 0..) = "
                  + " / ".join(f"{c:.2f}" for c in costs["verify_cost"]) + f" ({costs['description']})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH",
                        help="drafter folder saved by the recipe (repeatable; default: the main job's and the long "
                             "recipe's, those that exist)")
    parser.add_argument("--num-prompts", type=int, default=80, help="MT-bench prompts (all 80 by default)")
    parser.add_argument("--code-prompts", type=int, default=40, help="code-completion prompts (more-itertools)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/speedup.json")
    parser.add_argument("--force", action="store_true", help="recompute pairs already in the output")
    parser.add_argument("--sets", nargs="+", choices=("mtbench", "code"), default=["mtbench", "code"])
    parser.add_argument("--served-only", action="store_true",
                        help="only the served rule (and target, fast_plain): skip the speculative alternatives")
    args = parser.parse_args(argv)
    drafters = dict(item.split("=", 1) for item in args.drafter) if args.drafter else {
        name: path for name, path in DEFAULT_DRAFTERS.items() if Path(path).is_dir()}
    missing = [f"{name}={path}" for name, path in drafters.items() if not (Path(path) / "config.json").is_file()]
    if not drafters or missing:
        parser.error(f"No drafter folder to benchmark ({missing or 'none found'}): run the main job first "
                     "(accelerate launch recipes/ppow_llama.py), or pass --drafter NAME=PATH.")

    threads = set_cpu_threads()
    out_path = Path(args.out)
    results = json.loads(out_path.read_text()) if out_path.is_file() else {"runs": {}}
    target_path = smollm2_path()
    target = load_target(target_path)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    sizes = {"mtbench": args.num_prompts, "code": args.code_prompts}
    sets = {name: load_prompts(name, num_samples=sizes[name]) for name in args.sets}
    for name, folder in drafters.items():
        bench_drafters = variants(Path(folder))[: 1 if args.served_only else None]
        served = bench_drafters[0]
        for set_name, prompts in sets.items():
            key = f"{name}/{set_name}"
            if key in results["runs"] and not args.force:
                print(f"[speedup] {key}: already in {out_path}, skipped (--force recomputes)")
                continue
            print(f"[speedup] {key}: {len(prompts)} prompts, {args.max_new_tokens} tokens, served rule: "
                  f"{describe_serving_rule(served.policy, served.cost_model)}")
            report = run_benchmark(target, tokenizer, bench_drafters, prompts,
                                   methods=("target", "fast_plain", "fast_adaptive", "hook"), modes=("greedy",),
                                   max_new_tokens=args.max_new_tokens)
            # the hook runs the served rule only; the alternatives are measured in our loop
            report["records"] = [r for r in report["records"] if r["method"] != "hook" or r["drafter"] == "served"]
            report["summary"] = [r for r in report["summary"] if r["method"] != "hook" or r["drafter"] == "served"]
            results["runs"][key] = {
                "drafter": str(folder), "prompts": set_name, "num_prompts": len(prompts),
                "max_new_tokens": args.max_new_tokens, "precision": "fp32", "threads": threads,
                "date": datetime.date.today().isoformat(),
                "served_rule": describe_serving_rule(served.policy, served.cost_model),
                "policy": {"max_window": served.policy.max_window, "threshold": served.policy.threshold,
                           "guard": served.policy.guard, "calibration": served.policy.calibration},
                "cost_model": {"drafter_cost": served.cost_model.drafter_cost,
                               "verify_cost": served.cost_model.verify_cost,
                               "description": served.cost_model.description},
                "rows": summarize(report),
            }
            results["machine"] = machine_info(next(target.parameters()).device)
            results["command"] = "python " + " ".join(sys.argv)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(results, indent=1, default=float))
            out_path.with_suffix(".md").write_text(markdown(results))
            for row in results["runs"][key]["rows"]:
                ci = row["speedup_median_ci95"]
                print(f"  {row['label']:36s} tau {row['tau']:.3f}  speedup {row['speedup_median']:.3f}x "
                      f"[{ci[0]:.3f}, {ci[1]:.3f}]  lossless {row['lossless_prompts']}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
