"""DFlash block drafters: the stock native route's fixed block against the adaptive window, from the study's drafters.

    python benchmarks/dflash_block.py      # after `python benchmarks/study.py --arms dflash_kd dflash_ppow`

Stock ``target.generate(assistant_model=drafter, speculation_type="dflash")`` proposes ``block_size - 1`` = 7 tokens
every round; ``load_assistant`` adds our window rule. For each saved DFlash arm (and, for the per-token drafters,
the study's truncated and EAGLE-3 KD arms, side by side), on SmolLM2-135M-Instruct, fp32, CPU, 1 thread:

- the cost model up to the full block (``calibrate_cost_model(max_window=7)``, 15 interleaved repeats): ``t_d/t_t``
  (per round for the block drafters, per drafted token for the others) and ``t_v(L)/t_t`` for ``L = 0..7``;
- exact greedy tau on the study's 80 MT-bench prompts (128 tokens) at the fixed block (K = 7, the stock route) and
  at the policy saved with the arm, with bootstrap intervals over prompts;
- the cost-model speedup on the study's held-out calibration contexts (greedy) of the fixed block, of K = 4 and of
  the best ``(K <= 7, h)`` (``calibrate_policy``'s grid).

Writes ``benchmarks/results/dflash_block.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ppow_trl.serving.calibration import calibrate_policy, held_out_contexts
from ppow_trl.core.cost import calibrate_cost_model
from ppow_trl.data import stop_token_ids
from ppow_trl.study.evaluate import greedy_records, summarize
from ppow_trl.study.runner import WORK, StudyConfig, _load, _load_drafter
from ppow_trl.utils import set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy

BLOCK_ARMS = ("dflash_kd", "dflash_ppow")
TOKEN_ARMS = ("kd", "eagle3_kd")  # per-token drafters, for the cost columns
OUT = Path("benchmarks/results/dflash_block.json")
FULL_BLOCK = 7


def main() -> None:
    threads = set_cpu_threads()
    config = StudyConfig()
    target, tokenizer, _, calibration, tests, _ = _load(config)
    eos, vocab = stop_token_ids(target, tokenizer), len(tokenizer)
    contexts = held_out_contexts(calibration["prompt_ids"], calibration["response_ids"], 4)
    # resumable: finished arms are kept (each is written as soon as it is measured)
    rows = json.loads(OUT.read_text())["arms"] if OUT.is_file() else {}
    for name in BLOCK_ARMS + TOKEN_ARMS:
        if name in rows:
            continue
        folder = WORK / name
        if not (folder / "config.json").is_file():
            print(f"skip {name}: no {folder}")
            continue
        start = time.perf_counter()
        drafter = _load_drafter(folder).eval()
        cost = calibrate_cost_model(target, drafter, FULL_BLOCK, repeats=15)
        row = {"drafter_cost": cost.drafter_cost, "drafter_per_round": cost.drafter_per_round,
               "verify_cost": cost.verify_cost}
        if name in BLOCK_ARMS:
            saved = AdaptiveWindowPolicy.from_pretrained(folder) if (folder / "ppow_window_policy.json").is_file() \
                else None
            policies = {"fixed_block": AdaptiveWindowPolicy(FULL_BLOCK, 0.0)}
            if saved is not None:
                policies["saved_policy"] = saved
            row["mtbench_greedy"] = {}
            for key, policy in policies.items():
                summary = summarize(greedy_records(target, drafter, tests["mtbench"], policy,
                                                   max_new_tokens=config.data.eval_max_new_tokens, eos_token_ids=eos,
                                                   vocab_size=vocab))
                row["mtbench_greedy"][key] = {"policy": [policy.max_window, policy.threshold],
                                              **{k: summary[k] for k in ("tau", "tau_ci", "expected_accepted",
                                                                         "expected_accepted_ci") if k in summary}}
            chosen, report = calibrate_policy(target, drafter, contexts, cost, max_window=FULL_BLOCK, regime="greedy",
                                              vocab_size=vocab, pad_id=tokenizer.pad_token_id)
            grid = report["grid"]["greedy"]
            pick = {(r["max_window"], r["threshold"]): r["speedup"] for r in grid}
            row["predicted_speedup"] = {"fixed_block_k7": pick[(FULL_BLOCK, 0.0)], "fixed_k4": pick[(4, 0.0)],
                                        "best": {"max_window": chosen.max_window, "threshold": chosen.threshold,
                                                 "speedup": chosen.calibration["predicted_speedup"]}}
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows[name] = row
        print(name, json.dumps(row)[:400], flush=True)
        OUT.write_text(json.dumps({
            "command": "python benchmarks/dflash_block.py", "threads": threads, "precision": "fp32",
            "target": "SmolLM2-135M-Instruct (offline)", "contexts": len(contexts),
            "mtbench_prompts": len(tests["mtbench"]), "max_new_tokens": config.data.eval_max_new_tokens,
            "arms": rows}, indent=2) + "\n")
        print("wrote", OUT, flush=True)


if __name__ == "__main__":
    main()
