"""Which llama.cpp build runs on this CPU: the CMake options `make llama-cpp` builds with, and the AMX fault.

**The fault.** llama.cpp built for the machine it runs on (``GGML_NATIVE=ON``, the default, ``-march=native``)
compiles its AMX backend on CPUs with AMX (Intel Xeon Sapphire Rapids and later: ``amx_tile``, ``amx_int8``,
``amx_bf16`` in ``/proc/cpuinfo``). Quantized weights (Q4_0, Q4_1, Q8_0, ...) are then placed in the AMX buffer
type, and with llama-cpp-python 0.3.36 the first evaluation of every quantized model crashed with a segmentation
fault inside ``ggml_backend_amx_mul_mat`` (tiny drafters and SmolLM2's own Q4_1 file alike; F32 and F16 files, which
the AMX buffer does not take, ran).

**The fix.** On a CPU with AMX, build llama.cpp without its AMX backend: ``GGML_NATIVE=OFF`` (``-march=native`` is
what switches AMX on) and every other instruction set of the CPU named one by one (AVX2, FMA, F16C, BMI2, AVX-512
with VBMI, VNNI and BF16, AVX-VNNI, as ``/proc/cpuinfo`` lists them), ``GGML_AMX_*=OFF``. Quantized matrix products
then run on the AVX-512 kernels. Elsewhere the native build is kept. `cmake_args` computes these options;
`make llama-cpp` (``tools/llama_cpp_setup.py``) builds with them and keeps the wheel per set of options.

`amx_fault_expected` tells, without running anything, whether the installed build on this CPU has the fault's
ingredients; `load_llama` refuses quantized files then, naming the fix, instead of crashing the process.
`quantized_eval_probe` runs one quantized evaluation in a child process and reports a crash as a message.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ..utils import cpu_flags

# /proc/cpuinfo flag -> the ggml CMake option that enables it when GGML_NATIVE is OFF (ggml/src/ggml-cpu/CMakeLists.txt).
GGML_ISA_OPTIONS = {
    "sse4_2": "GGML_SSE42",
    "avx": "GGML_AVX",
    "f16c": "GGML_F16C",
    "fma": "GGML_FMA",
    "bmi2": "GGML_BMI2",
    "avx2": "GGML_AVX2",
    "avx_vnni": "GGML_AVX_VNNI",
    "avx512f": "GGML_AVX512",
    "avx512vbmi": "GGML_AVX512_VBMI",
    "avx512_vnni": "GGML_AVX512_VNNI",
    "avx512_bf16": "GGML_AVX512_BF16",
}
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
# ggml's GGML_AVX512 option adds -mavx512f/cd/vl/dq/bw together: only when the CPU has all five.
AVX512_BASE = ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
QUANTIZED_PROBE_TIMEOUT_S = 120


def has_amx(flags: set[str]) -> bool:
    return any(flag in flags for flag in AMX_FLAGS)


def cmake_args(flags: set[str]) -> list[str]:
    """CMake options for llama.cpp on a CPU with ``flags``: ``[]`` (native build) without AMX; with AMX, the native
    instruction sets named one by one and the AMX backend off (module docstring)."""
    if not has_amx(flags):
        return []
    options = ["-DGGML_NATIVE=OFF"]
    for flag, option in GGML_ISA_OPTIONS.items():
        present = flag in flags
        if option.startswith("GGML_AVX512"):  # the extensions only on top of the five base sets
            present = present and all(f in flags for f in AVX512_BASE)
        options.append(f"-D{option}={'ON' if present else 'OFF'}")
    options += [f"-DGGML_{flag.upper()}=OFF" for flag in AMX_FLAGS]
    return options


def build_features() -> dict[str, str]:
    """The CPU features the installed llama.cpp was compiled with (``llama_print_system_info``: ``{"AVX2": "1",
    "AMX_INT8": "1", ...}``); ``{}`` without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return {}
    info = llama_cpp.llama_print_system_info()
    info = info.decode() if isinstance(info, bytes) else str(info)
    return dict(re.findall(r"([A-Z0-9_]+) = ([^ |]+)", info))


def amx_fault_expected(flags: set[str] | None = None, features: dict[str, str] | None = None) -> bool:
    """Whether this CPU has AMX and the installed llama.cpp was built with its AMX backend: quantized models then
    crashed at their first evaluation (module docstring)."""
    flags = cpu_flags() if flags is None else flags
    features = build_features() if features is None else features
    return has_amx(flags) and features.get("AMX_INT8") == "1"


AMX_FAULT_MESSAGE = (
    "This CPU has AMX and the installed llama.cpp was built with its AMX backend, which crashed (segmentation "
    "fault in ggml_backend_amx_mul_mat) on every quantized model with llama-cpp-python 0.3.36. Rebuild it without "
    "AMX: `make llama-cpp` does (it passes {args}), or `CMAKE_ARGS=\"{args}\" pip install --no-cache-dir "
    "--force-reinstall --no-deps llama-cpp-python==0.3.36`. F32 and F16 files are not affected."
)


def amx_fault_message(flags: set[str] | None = None) -> str:
    return AMX_FAULT_MESSAGE.format(args=" ".join(cmake_args(cpu_flags() if flags is None else flags)))


_PROBE = """
import sys
import llama_cpp
llama = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_threads=1, n_threads_batch=1, verbose=False, seed=0)
llama.eval(llama.tokenize(b"The capital of France is"))
print("ok")
"""


def quantized_eval_probe(gguf_path: str | Path, timeout: float = QUANTIZED_PROBE_TIMEOUT_S) -> str | None:
    """Evaluate a few tokens of the quantized GGUF ``gguf_path`` with llama.cpp in a child process; ``None`` when it
    ran, else a message saying how it ended (a crash kills the child, not the caller)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE, str(gguf_path)], capture_output=True, text=True,
                                timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not evaluate {Path(gguf_path).name} within {timeout:.0f} s."
    if result.returncode == 0 and result.stdout.strip().endswith("ok"):
        return None
    how = (f"was killed by signal {-result.returncode}" if result.returncode < 0
           else f"exited with code {result.returncode}")
    hint = amx_fault_message() if has_amx(cpu_flags()) else "Rebuild llama-cpp-python with `make llama-cpp`."
    return (f"llama.cpp {how} evaluating the quantized {Path(gguf_path).name}. {hint}\n"
            f"{result.stderr.strip()[-1500:]}")
