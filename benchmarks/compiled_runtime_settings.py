"""Choose the compiled runtime's inductor settings by measurement (ppow_trl.compiled_runtime.compiled).

For each setting: cold compile seconds (empty inductor cache), warm start seconds (a new process, the cache filled),
the one-token step t_t and verify costs t_v(L) for L = 2..5 rows, on SmolLM2-135M-Instruct (fp32 weights, or bf16 for
settings named ``bf16:<setting>``), one thread, a
static cache of 256 positions, measured after a 64-token prompt; the eager row is transformers' eager forward over
its dynamic cache, as the serving loop ran it before. Row counts are interleaved in each repetition, and every
figure is a median. Each setting runs in child processes, so that compiling one cannot warm another.

    python benchmarks/compiled_runtime_settings.py [--settings eager,freezing,freezing+max-autotune] [--reps 30]
    python benchmarks/compiled_runtime_settings.py --settings bf16:eager,bf16:freezing+max-autotune --append
    python benchmarks/compiled_runtime_settings.py --settings row-independent,packaged --append
    python benchmarks/compiled_runtime_settings.py --settings packaged,packaged-1-worker,packaged-2-workers --append

Writes benchmarks/results/compiled_runtime_settings.json and .md.
"""

from __future__ import annotations

import contextlib
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTINGS = {
    "eager": None,
    "freezing": {"freezing": True},
    # the graphs of PyTorch's attention, compiled by torch.compile in each process (the defaults before row independence)
    "freezing+max-autotune": {"freezing": True, "max_autotune": True, "gemm_backends": "CPP,ATEN",
                              "row_independent": False, "packaged": False},
    # row-independent graphs (attention padded to K_max + 1 rows, only the C++ GEMM template), torch.compile
    "row-independent": {"packaged": False},
    # the defaults: row-independent graphs kept as AOTInductor packages (a warm start loads them), built several at
    # once in worker processes (2 on a 2-core machine at one thread)
    "packaged": {},
    # the same packages built one by one in the serving process, or two at once
    "packaged-1-worker": {},
    "packaged-2-workers": {},
}
ENVIRONMENT = {"packaged-1-worker": {"PPOW_TRL_BUILD_WORKERS": "1"}, "packaged-2-workers": {"PPOW_TRL_BUILD_WORKERS": "2"}}
"""Environment variables of a setting's processes (what is not an inductor setting)."""
# A setting may name a weight dtype: "bf16:eager", "bf16:freezing+max-autotune" (fewer bytes per decoded token).
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _split(name: str) -> tuple[str, str]:
    dtype, _, setting = name.rpartition(":")
    return DTYPES[dtype or "fp32"], setting
MAX_ROWS = 5
PROMPT = 64


def child(name: str, reps: int) -> dict:
    import torch

    from ppow_trl.compiled_runtime.compiled import CompiledCausalLM, CompileSettings
    from ppow_trl.features import forward_at
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.utils import crop_cache

    torch.set_num_threads(1)
    dtype, setting = _split(name)
    target = load_target(smollm2_path()).eval().to(getattr(torch, dtype))
    compile_s = 0.0
    model = target
    if SETTINGS[setting] is not None:
        model = CompiledCausalLM(target, max_rows=MAX_ROWS, max_cache_len=256,
                                 settings=CompileSettings(**SETTINGS[setting]))
        compile_s = model.warm_up(progress=False)
    prompt = torch.randint(100, 40000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    times = {rows: [] for rows in range(1, MAX_ROWS + 1)}
    with torch.no_grad():
        out, _ = forward_at(model, prompt, None, 0, logits_to_keep=1)
        cache = out.cache
        for rep in range(reps + 2):
            for rows in range(1, MAX_ROWS + 1):
                tokens = prompt[:rows]
                start = time.perf_counter()
                forward_at(model, tokens, cache, PROMPT)
                elapsed = 1000 * (time.perf_counter() - start)
                crop_cache(cache, PROMPT)
                if rep >= 2:  # two warm-up repetitions
                    times[rows].append(elapsed)
    medians = {rows: statistics.median(values) for rows, values in times.items()}
    import resource

    # peak resident memory of this process and of the largest build worker it ran (ru_maxrss is in KiB on Linux)
    memory = {"peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
              "build_worker_peak_rss_gb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20, 2)}
    # resident memory now, serving: anonymous (this process's own copies) and file-backed (mapped files, which the
    # kernel can drop and read again); Linux only
    with contextlib.suppress(OSError):
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        memory.update({f"{key.lower().replace('rss', 'rss_')}_gb": round(int(status[key].split()[0]) / 1e6, 2)
                       for key in ("RssAnon", "RssFile") if key in status})
    return {"setting": name, "dtype": dtype, "compile_s": round(compile_s, 1), "t_t_ms": round(medians[1], 2), **memory,
            **{f"t_v{rows}/t_t": round(medians[rows] / medians[1], 3) for rows in range(2, MAX_ROWS + 1)}}


def run_child(name: str, reps: int, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir,
           "OMP_NUM_THREADS": "1", "PPOW_TRL_NUM_THREADS": "1", **ENVIRONMENT.get(_split(name)[1], {})}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, __file__, "--child", name, "--reps", str(reps)], env=env,
                            capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise RuntimeError(f"{name}: {result.stderr[-3000:]}")
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    measured["process_s"] = round(time.perf_counter() - started, 1)
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "compiled_runtime_settings.json")
    parser.add_argument("--append", action="store_true", help="keep the rows already in --out (other settings)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return 0

    sys.path.insert(0, str(REPO))
    from benchmarks.llama_cpp_amx_build import cpu_description

    rows = []
    if args.append and args.out.is_file():
        asked = set(args.settings.split(","))
        rows = [row for row in json.loads(args.out.read_text())["rows"] if row["setting"] not in asked]
    for name in args.settings.split(","):
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
            cold = run_child(name, args.reps, cache_dir)
            warm = run_child(name, args.reps, cache_dir) if SETTINGS[_split(name)[1]] is not None else None
            # what the compiled runtime keeps on disk: packages and their weights, inductor's kernels and autotuning
            disk = sum(path.stat().st_size for path in Path(cache_dir).rglob("*") if path.is_file())
        row = {**cold, "cold_compile_s": cold["compile_s"], "warm_start_s": warm["compile_s"] if warm else 0.0,
               "cache_disk_gb": round(disk / 1e9, 2)}
        if warm:  # the second process's timings (the same kernels, a second sample of the machine) and memory
            row["warm_t_t_ms"] = warm["t_t_ms"]
            row.update({f"warm_{key}": warm[key] for key in ("peak_rss_gb", "rss_anon_gb", "rss_file_gb") if key in warm})
        row.pop("compile_s")
        rows.append(row)
        print(json.dumps(row), flush=True)
    import torch

    report = {"command": "python benchmarks/compiled_runtime_settings.py " + " ".join(sys.argv[1:]),
              "cpu": cpu_description(), "torch": torch.__version__,
              "setup": f"SmolLM2-135M-Instruct (dtype per row), 1 thread, static cache 256, {PROMPT}-token prompt, "
                       f"{args.reps} interleaved repetitions, medians", "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    keys = ["setting", "cold_compile_s", "warm_start_s", "t_t_ms", "warm_t_t_ms"] + [f"t_v{r}/t_t" for r in range(2, MAX_ROWS + 1)]
    lines = [f"CPU: {report['cpu']}; {report['setup']}; torch {report['torch']}.", "",
             "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
