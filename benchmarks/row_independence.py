"""Does a verify pass compute bitwise what decode steps compute, and what does making it so cost?

For each precision (fp32, int8) and ``CompileSettings(row_independent=False | True)``, SmolLM2-135M-Instruct served by
``serving_runtime`` (compiled, K_max = 4, 512-position cache): plain-decode 40 tokens after an MT-bench-style prompt,
then verify the same tokens in windows of L = 2..5 rows from the same cache states, and count the rows whose logits
differ in any bit from the decode step's; then the median decode step t_t (60 calls) and t_v(L)/t_t over a 200-token
context. Each configuration runs in its own process, one after the other (nothing else should run beside it).

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
CONFIGS = [("fp32", True), ("int8", True), ("fp32", False), ("int8", False)]  # the cold compiles first


def child(precision: str, row_independent: bool, threads: int) -> dict:
    import statistics
    import time

    import torch
    from transformers import AutoTokenizer

    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.serving.compiled import CompileSettings
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

        context = torch.randint(100, 40000, (1, 200), generator=torch.Generator().manual_seed(0))

        def step_ms(rows: int, calls: int = 60) -> float:
            cache = model.new_cache()
            model(input_ids=context, cache=cache)
            ids = torch.tensor([tokens[:rows]])
            times = []
            for _ in range(calls + 3):
                t0 = time.perf_counter()
                model(input_ids=ids, cache=cache)
                times.append(time.perf_counter() - t0)
                cache.crop(-rows)
            return statistics.median(times[3:]) * 1e3

        t_t = step_ms(1)
        t_v = {rows: round(step_ms(rows) / t_t, 3) for rows in (2, 3, 4, 5)}
    return {"precision": precision, "row_independent": row_independent, "runtime": served.describe(),
            "warm_up_s": round(warm_up_s, 1), "rows_differing": {str(k): f"{differing[k]}/{compared[k]}"
                                                                  for k in differing},
            "t_t_ms": round(t_t, 2), "t_v(L)/t_t for L = 2..5 rows": [t_v[r] for r in (2, 3, 4, 5)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "1", args.threads)))
        return
    sys.path.insert(0, str(REPO))
    from benchmarks.llama_cpp_amx_build import cpu_description

    import torch

    results = []
    for precision, row_independent in CONFIGS:
        print(f"{precision}, row_independent={row_independent} ...", flush=True)
        run = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--child", precision,
                              "1" if row_independent else "0"], capture_output=True, text=True, check=True)
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    out = {"meta": {"cpu": cpu_description(), "torch": torch.__version__, "threads": args.threads,
                    "model": "SmolLM2-135M-Instruct", "runtime": "compiled (serving_runtime, K_max = 4, 512 positions)",
                    "command": "python benchmarks/row_independence.py" + (f" --threads {args.threads}"
                                                                         if args.threads != 1 else "")},
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
