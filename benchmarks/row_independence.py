"""Does a verify pass compute bitwise what decode steps compute, and what does making it so cost?

For each precision (fp32, int8) and ``CompileSettings(row_independent=True | False)`` (True is the default: attention
padded to K_max + 1 query rows, ``ppow_trl.compiled_runtime.attention``), SmolLM2-135M-Instruct served by ``serving_runtime``
(compiled, K_max = 4, 512-position cache):

- rows: plain-decode 40 tokens after an MT-bench-style prompt, then verify the same tokens in windows of L = 2..5 rows
  from the same cache states, and count the rows whose logits differ in any bit from the decode step's (one process
  per configuration);
- costs: both configurations of a precision in one process, their calls interleaved (each round times one call of
  every row count of each configuration, in a rotating order) over a 200-token context: the median decode step t_t
  with its 95% CI, t_v(L)/t_t, and row_independent=True against False at the same precision (ratio of medians, 95%
  bootstrap CI).

    python benchmarks/row_independence.py            # writes benchmarks/results/row_independence.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "row_independence.json"
CONFIGS = [("fp32", True), ("int8", True), ("fp32", False), ("int8", False)]  # the defaults first


def timing_key(precision: str, row_independent: bool) -> str:
    """The key of a configuration's costs in the timing child's output."""
    return f"{precision}/{'row_independent' if row_independent else 'default_attention'}"


def child(precision: str, row_independent: bool, threads: int) -> dict:
    import time

    import torch
    from transformers import AutoTokenizer

    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.compiled_runtime.compiled import CompileSettings
    from ppow_trl.serving.runtime import serving_runtime
    from ppow_trl.utils import set_cpu_threads

    set_cpu_threads(threads)
    target = load_target(smollm2_path()).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    started = time.perf_counter()
    served = serving_runtime(target, None, runtime="compiled", max_window=4, max_cache_len=512, precision=precision,
                             settings=CompileSettings(row_independent=row_independent), progress=False)
    warm_up_s = time.perf_counter() - started
    model = served.target
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a short story about a robot learning "
                                             "to paint."}], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    with torch.no_grad():
        def fresh():
            cache = model.new_cache()
            return cache, model(input_ids=prompt, cache=cache).logits[:, -1].argmax(-1, keepdim=True)

        cache, token = fresh()
        tokens, decoded = [], []
        for _ in range(40):
            tokens.append(int(token))
            logits = model(input_ids=token, cache=cache).logits[:, -1]
            decoded.append(logits[0].clone())
            token = logits.argmax(-1, keepdim=True)
        differing, compared = {}, {}
        for rows in (2, 3, 4, 5):
            differing[rows] = compared[rows] = 0
            for start in range(0, 40 - rows, rows):
                cache, _ = fresh()
                for t in tokens[:start]:
                    model(input_ids=torch.tensor([[t]]), cache=cache)
                out = model(input_ids=torch.tensor([tokens[start:start + rows]]), cache=cache).logits[0]
                differing[rows] += sum(not torch.equal(out[r], decoded[start + r]) for r in range(rows))
                compared[rows] += rows

    return {"precision": precision, "row_independent": row_independent, "runtime": served.describe(),
            "warm_up_s": round(warm_up_s, 1), "rows_differing": {str(k): f"{differing[k]}/{compared[k]}"
                                                                  for k in differing},
}


def timing_child(threads: int, rounds: int, precision: str) -> dict:
    """Both configurations of ``precision`` in one process (a copy of the target each: one set of compile settings
    per model), their calls interleaved round by round; medians and bootstrap intervals (module docstring). One
    precision per process: a compiled SmolLM2 runtime held about 3.8 GB, and four in one process were killed for
    memory on a 24 GB machine."""
    import copy
    import statistics
    import time

    import torch

    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.compiled_runtime.compiled import CompileSettings
    from ppow_trl.serving.runtime import serving_runtime
    from ppow_trl.utils import set_cpu_threads

    sys.path.insert(0, str(REPO))
    from benchmarks.llama_cpp_amx_build import bootstrap_ratio_ci
    from benchmarks.speedup import bootstrap_median

    set_cpu_threads(threads)
    base = load_target(smollm2_path()).eval()
    configs = [config for config in CONFIGS if config[0] == precision]
    models = {config: serving_runtime(copy.deepcopy(base), None, runtime="compiled", max_window=4, max_cache_len=512,
                                      precision=config[0], settings=CompileSettings(row_independent=config[1]),
                                      progress=False).target
              for config in configs}
    del base
    context = torch.randint(100, 40000, (1, 200), generator=torch.Generator().manual_seed(0))
    ids = torch.randint(100, 40000, (1, 5), generator=torch.Generator().manual_seed(1))
    samples = {config: {rows: [] for rows in range(1, 6)} for config in configs}
    with torch.no_grad():
        caches = {}
        for config, model in models.items():
            caches[config] = model.new_cache()
            model(input_ids=context, cache=caches[config])
        for round_ in range(rounds + 3):  # 3 rounds of warm-up, not kept
            order = configs[round_ % len(configs):] + configs[:round_ % len(configs)]
            for config in order:
                for rows in range(1, 6):
                    started = time.perf_counter()
                    models[config](input_ids=ids[:, :rows], cache=caches[config])
                    elapsed = (time.perf_counter() - started) * 1e3
                    caches[config].crop(-rows)
                    if round_ >= 3:
                        samples[config][rows].append(elapsed)
    out = {}
    for precision, row_independent in configs:
        times = samples[(precision, row_independent)]
        t_t = statistics.median(times[1])
        entry = {"t_t_ms": round(t_t, 2), "t_t_ci_ms": [round(x, 2) for x in bootstrap_median(times[1])],
                 "t_v(L)/t_t for L = 2..5 rows": [round(statistics.median(times[r]) / t_t, 3) for r in (2, 3, 4, 5)]}
        if row_independent:  # against the other settings at this precision, side by side
            other = samples[(precision, False)]
            entry["vs row_independent=False, t(L) ratio for L = 1..5 [95% CI]"] = [
                [round(statistics.median(times[r]) / statistics.median(other[r]), 3),
                 bootstrap_ratio_ci(times[r], other[r])] for r in range(1, 6)]
        out[timing_key(precision, row_independent)] = entry
    return {"rounds": rounds, "timings": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--rounds", type=int, default=60, help="interleaved timing rounds")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--timing-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "1", args.threads)))
        return
    if args.timing_child:
        print(json.dumps(timing_child(args.threads, args.rounds, args.timing_child)))
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.llama_cpp_amx_build import cpu_description

    import torch

    # Finished parts are kept in a partial file, so that a rerun after a crash does not compile and measure them again.
    partial_path = args.out.with_suffix(".partial.json")
    partial = json.loads(partial_path.read_text()) if partial_path.is_file() else {}

    def run_child(key: str, child_args: list[str]) -> dict:
        if key not in partial:
            run = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), *child_args],
                                 capture_output=True, text=True, check=True)
            partial[key] = json.loads(run.stdout.strip().splitlines()[-1])
            args.out.parent.mkdir(parents=True, exist_ok=True)
            partial_path.write_text(json.dumps(partial, indent=1) + "\n")
        print(json.dumps(partial[key]), flush=True)
        return partial[key]

    results = []
    for precision, row_independent in CONFIGS:
        print(f"{precision}, row_independent={row_independent} ...", flush=True)
        results.append(dict(run_child(f"{precision}/{row_independent}",
                                      ["--child", precision, "1" if row_independent else "0"])))
    for precision in dict.fromkeys(precision for precision, _ in CONFIGS):
        print(f"timing {precision}, both settings interleaved ...", flush=True)
        timing = run_child(f"timing/{precision}", ["--rounds", str(args.rounds), "--timing-child", precision])
        for result in results:
            if result["precision"] == precision:
                result.update(timing["timings"][timing_key(precision, result["row_independent"])])
    out = {"meta": {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads,
                    "model": "SmolLM2-135M-Instruct", "runtime": "compiled (serving_runtime, K_max = 4, 512 positions)",
                    "command": "python benchmarks/row_independence.py" + (f" --threads {args.threads}"
                                                                         if args.threads != 1 else "")},
           "timing_rounds": args.rounds, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    partial_path.unlink()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
