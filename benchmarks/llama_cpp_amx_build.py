"""What the llama.cpp build for AMX CPUs costs: the options `make llama-cpp` uses there, against the native build.

On a CPU with AMX, `make llama-cpp` builds llama.cpp with ``GGML_NATIVE=OFF``, the CPU's instruction sets named one
by one and the AMX backend off (ppow_trl/interop/llama_cpp_build.py), because the native build's AMX backend crashed on every
quantized model. On an AMX CPU the native build is therefore no alternative. What can be measured anywhere with
AVX-512 is the price of leaving ``-march=native``: this script builds the AMX options here (``--as-if-amx``), and times
the shipped SmolLM2-135M Q4_1 target in both builds side by side, one thread, arms alternated, each in a child process:

- decode: ms per token, one token per evaluation (32 tokens after a 16-token prompt);
- verify: ms for one evaluation of 5 tokens (a speculative window).

    python benchmarks/llama_cpp_amx_build.py [--rounds 7] [--out benchmarks/results/llama_cpp_amx_build.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
import llama_cpp
path = sys.argv[1]
llama = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False, seed=0)
info = llama_cpp.llama_print_system_info()
prompt = llama.tokenize(b"Write a short story about a lighthouse keeper who finds a message in a bottle.")[:16]
decode, verify = [], []
for repeat in range(3):
    llama.reset()
    llama.eval(prompt)
    token = prompt[-1]
    for _ in range(32):
        start = time.perf_counter()
        llama.eval([token])
        decode.append(1000 * (time.perf_counter() - start))
        token = int(llama.scores[llama.n_tokens - 1].argmax())
    base = llama.n_tokens
    for _ in range(8):
        llama.n_tokens = base  # eval drops the KV cache from n_tokens on: the same 5-token window each time
        start = time.perf_counter()
        llama.eval(prompt[:5])
        verify.append(1000 * (time.perf_counter() - start))
print(json.dumps({"decode_ms": decode, "verify5_ms": verify,
                  "system_info": info.decode() if isinstance(info, bytes) else str(info)}))
"""


def package_dir(source: Path, scratch: Path) -> Path:
    """A folder to put first on PYTHONPATH in which ``import llama_cpp`` finds ``source`` (a wheel or a package)."""
    target = scratch / source.stem
    target.mkdir(parents=True, exist_ok=True)
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            wheel.extractall(target)
    else:
        (target / "llama_cpp").symlink_to(source)
    return target


def cpu_description() -> dict:
    from ppow_trl.interop.llama_cpp_build import has_amx
    from ppow_trl.utils import cpu_flags, cpu_name

    flags = cpu_flags()
    return {"model": cpu_name(), "avx512f": "avx512f" in flags, "amx": has_amx(flags), "cores": os.cpu_count()}


def bootstrap_ratio_ci(a: list[float], b: list[float], draws: int = 2000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of median(a) / median(b)."""
    import random

    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b)))
                    for _ in range(draws))
    return [round(ratios[int(0.025 * draws)], 3), round(ratios[int(0.975 * draws)], 3)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native", type=Path, default=None, help="native build: a wheel or a llama_cpp package folder "
                        "(default: the installed one)")
    parser.add_argument("--no-amx", type=Path, default=None, help="the AMX-CPU options' build: a wheel (default: "
                        "built by tools/llama_cpp_setup.py --as-if-amx --wheel-only)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "llama_cpp_amx_build.json")
    args = parser.parse_args()

    from ppow_trl.interop.llama_cpp_build import cmake_args, cpu_flags
    from ppow_trl.offline import smollm2_gguf_path

    if args.native is None:
        import llama_cpp

        args.native = Path(llama_cpp.__file__).parent
    if args.no_amx is None:
        built = subprocess.run([sys.executable, str(REPO / "tools" / "llama_cpp_setup.py"), "--as-if-amx",
                                "--wheel-only"], capture_output=True, text=True, check=True)
        args.no_amx = Path(built.stdout.strip().splitlines()[-1])
    gguf = smollm2_gguf_path()
    samples = {"native": {"decode_ms": [], "verify5_ms": []}, "no_amx_options": {"decode_ms": [], "verify5_ms": []}}
    info = {}
    with tempfile.TemporaryDirectory() as scratch:
        paths = {"native": package_dir(args.native, Path(scratch) / "native"),
                 "no_amx_options": package_dir(args.no_amx, Path(scratch) / "no_amx")}
        for round_index in range(args.rounds):
            order = list(paths) if round_index % 2 == 0 else list(reversed(paths))
            for arm in order:
                env = {**os.environ, "PYTHONPATH": str(paths[arm]), "OMP_NUM_THREADS": "1"}
                result = subprocess.run([sys.executable, "-c", CHILD, str(gguf)], env=env, capture_output=True,
                                        text=True, check=True)
                measured = json.loads(result.stdout.strip().splitlines()[-1])
                info[arm] = measured.pop("system_info")
                for key, values in measured.items():
                    samples[arm][key].extend(values)
            print(f"round {round_index + 1}/{args.rounds}", flush=True)

    report = {
        "command": "python benchmarks/llama_cpp_amx_build.py " + " ".join(sys.argv[1:]),
        "cpu": cpu_description(),
        "model": f"{gguf.name} (Q4_1), 1 thread, n_ctx 256, llama-cpp-python 0.3.36",
        "no_amx_options": " ".join(cmake_args(cpu_flags() | {"amx_tile", "amx_int8", "amx_bf16"})),
        "system_info": info,
        "arms": {},
    }
    for arm, values in samples.items():
        report["arms"][arm] = {key: {"median": round(statistics.median(v), 3), "n": len(v)} for key, v in values.items()}
    for key in ("decode_ms", "verify5_ms"):
        a, b = samples["no_amx_options"][key], samples["native"][key]
        report[f"{key}_ratio_no_amx_over_native"] = {
            "median_ratio": round(statistics.median(a) / statistics.median(b), 3),
            "ci95": bootstrap_ratio_ci(a, b)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "system_info"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
