"""The record of a long recipe (issue 50, item 5): its drafter served side by side with plain decoding.

Reads the recipe's ``run_summary.json`` (training tokens, wall-clock), serves the recipe's ``merged/`` drafter with
``benchmarks/compiled_serving.py`` (compiled runtime, fp32, greedy, batch 1, one thread; 80 MT-bench and 40 code
prompts; the rule calibrated on this machine's costs; prompt lookup and the hybrid of the drafter with prompt lookup
beside it; resumable like that script; a drafter trained again into the same folder is served again) and writes, per prompt set, the served rule's speedup over compiled plain
decoding with its 95% interval, tau, lossless prompts, and the hybrid's figures:

    python benchmarks/long_recipe.py                                          # the 2-layer long recipe
    python benchmarks/long_recipe.py --family eagle3 --output_dir outputs/ppow-smollm2-eagle3-long \\
        --out benchmarks/results/long_recipe_eagle3.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def arm_record(arm: dict, rule: dict | None, rule_text: str | None) -> dict:
    """One arm's figures against its reference (compiled plain decoding at the same precision)."""
    return {"speedup": arm["speedup_vs_reference"], "ci95": arm["speedup_vs_reference_ci95"], "tau": arm["tau"],
            "lossless_prompts": arm["lossless_prompts"], "prompts": arm["prompts"],
            "ms_per_token_median": arm["ms_per_token_median"], "served_rule": rule, "rule": rule_text}


def long_recipe_record(summary: dict, serving: dict, family: str, threads: int = 1) -> dict:
    """``run_summary.json`` + a ``compiled_serving.py`` result -> the record item 5 asks for."""
    meta = serving["meta"][f"threads{threads}"]
    name = "eagle3" if family == "eagle3" else "ppow"
    record = {"family": family, "train_tokens": summary["train_tokens"], "hours": round(summary["minutes"] / 60, 2),
              "cpu": summary["cpu"], "config": summary["config"], "precision": "fp32", "runtime": "compiled",
              "threads": threads, "vs": "compiled_plain[fp32]", "serving_command": serving["command"],
              "cost_model": meta["cost_models"].get(name)}
    config = summary.get("config", {})
    record["setup"] = (f"The {family} drafter trained on {summary['train_tokens']:,} tokens "
                       f"({config.get('train_data', '?')} data, {config.get('kd_steps', '?')} KD steps) in "
                       f"{record['hours']} h of the recipe, then served against compiled plain decoding.")
    for set_name in ("mtbench", "code"):
        run = serving["runs"].get(f"threads{threads}/{set_name}")
        if run is None:
            continue
        arms = run["arms"]
        record[set_name] = arm_record(arms[f"compiled_speculative[{name}]"], meta.get("served_rules", {}).get(name),
                                      meta["rules"][name])
        # compiled_serving.py's hybrid pairs prompt lookup with its --drafter, the standalone one: not this head's
        for other in ("hybrid", "prompt_lookup") if family != "eagle3" else ("prompt_lookup",):
            if f"compiled_speculative[{other}]" in arms:
                record[set_name][f"with_{other}"] = arm_record(arms[f"compiled_speculative[{other}]"],
                                                               meta.get("served_rules", {}).get(other),
                                                               meta["rules"][other])
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, default=None,
                        help="the recipe's output_dir (default: outputs/ppow-smollm2-long or -eagle3-long)")
    parser.add_argument("--family", choices=["standalone", "eagle3"], default="standalone")
    parser.add_argument("--drafter", type=Path, default=None,
                        help="with --family eagle3: the standalone drafter served beside it (compiled_serving.py "
                             "needs one; default: the 2-layer long recipe's merged/)")
    parser.add_argument("--mtbench", type=int, default=80)
    parser.add_argument("--code", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "long_recipe.json")
    args = parser.parse_args(argv)
    if args.output_dir is None:
        args.output_dir = REPO / "outputs" / ("ppow-smollm2-eagle3-long" if args.family == "eagle3" else "ppow-smollm2-long")
    summary_path = args.output_dir / "run_summary.json"
    merged = args.output_dir / "merged"
    if not summary_path.is_file() or not (merged / "config.json").is_file():
        raise SystemExit(f"No finished recipe in {args.output_dir} (run_summary.json and merged/ are written at the "
                         "end of a run): run the long recipe first (recipes/configs/offline_smollm2_long.yaml).")
    drafter = merged
    extra = []
    if args.family == "eagle3":
        drafter = args.drafter or REPO / "outputs" / "ppow-smollm2-long" / "merged"
        extra = ["--eagle3", str(merged)]
    serving_out = args.out.with_name(args.out.stem + "_serving.json")
    command = [sys.executable, str(REPO / "benchmarks" / "compiled_serving.py"), "--drafter", str(drafter),
               "--threads", str(args.threads), "--precisions", "fp32", "--skip-hf-compiled", "--skip-llama-cpp",
               "--mtbench", str(args.mtbench), "--code", str(args.code), "--out", str(serving_out), *extra]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    record = long_recipe_record(json.loads(summary_path.read_text()), json.loads(serving_out.read_text()),
                                args.family, args.threads)
    record["command"] = "python benchmarks/long_recipe.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record.get(k) for k in ("train_tokens", "hours", "mtbench", "code")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
