"""`make llama-cpp`: install llama-cpp-python, built from source for this CPU, without the AMX fault.

The CMake options come from `ppow_trl.interop.llama_cpp_build.cmake_args` (the native build, or on a CPU with AMX the same
instruction sets without the AMX backend), plus ``-DLLAVA_BUILD=OFF`` and whatever ``$CMAKE_ARGS`` adds. The wheel is
built once per (version, options) under ``<cache_root>/wheels/`` and installed from there: pip's own wheel cache
ignores CMAKE_ARGS and would hand back a wheel built with other options. Nothing is rebuilt when the installed
bindings are this version and have no AMX fault on this CPU.

    python tools/llama_cpp_setup.py [--constraints FILE] [--as-if-amx] [--print-args] [--wheel-only] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from ppow_trl.build_once import build_once
from ppow_trl.interop.llama_cpp_build import AMX_FLAGS, amx_fault_expected, cmake_args, cpu_flags
from ppow_trl.utils import cache_root

VERSION = "0.3.36"


def installed_version() -> str | None:
    try:
        return metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constraints", default=None, help="pip constraints file for the bindings' dependencies")
    parser.add_argument("--as-if-amx", action="store_true",
                        help="use the options of an AMX CPU here (to measure what they cost on this machine)")
    parser.add_argument("--print-args", action="store_true", help="print the CMake options and exit")
    parser.add_argument("--wheel-only", action="store_true", help="build (or find) the wheel, print its path, install nothing")
    parser.add_argument("--force", action="store_true", help="reinstall even when the installed bindings are fine")
    args = parser.parse_args()

    flags = cpu_flags() | (set(AMX_FLAGS) if args.as_if_amx else set())
    options = cmake_args(flags) + ["-DLLAVA_BUILD=OFF"] + os.environ.get("CMAKE_ARGS", "").split()
    native = "-DGGML_NATIVE=OFF" not in options
    if args.print_args:
        print(" ".join(options))
        return 0
    extra = os.environ.get("CMAKE_ARGS", "").split()
    if not (args.force or args.as_if_amx or extra) and installed_version() == VERSION and not amx_fault_expected(flags):
        print(f"llama-cpp-python {VERSION} is installed and has no AMX fault on this CPU; nothing to do.")
        return 0
    # A native build (-march=native) runs only on CPUs with the same instruction sets: they are part of its key.
    cpu = f"{platform.machine()} {' '.join(sorted(flags))}" if native else platform.machine()
    key = hashlib.sha256(f"{VERSION} {' '.join(options)} {sys.version_info[:2]} {cpu}".encode()).hexdigest()[:12]
    folder = cache_root() / "wheels" / f"llama-cpp-python-{VERSION}-{key}"

    def build(tmp: Path) -> None:
        print(f"Building llama-cpp-python {VERSION} for this CPU with CMAKE_ARGS={' '.join(options)!r} "
              f"(about 5 min on 2 cores; kept in {folder})", flush=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir",
                        "--no-binary", "llama-cpp-python", "-w", str(tmp), f"llama-cpp-python=={VERSION}"],
                       env={**os.environ, "CMAKE_ARGS": " ".join(options)}, check=True)
        (tmp / "CMAKE_ARGS").write_text(" ".join(options) + "\n")
        print(f"Built in {time.monotonic() - started:.0f} s.", flush=True)

    build_once(folder, build, required=["CMAKE_ARGS"], what="llama-cpp-python wheel")
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise SystemExit(f"{folder} holds no wheel; delete it and run `make llama-cpp` again.")
    if args.wheel_only:
        print(wheels[0])
        return 0
    install = [sys.executable, "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(wheels[0])]
    subprocess.run(install, check=True)
    # its dependencies (numpy, diskcache, jinja2, typing-extensions), at the tested versions
    deps = [sys.executable, "-m", "pip", "install", "-q", str(wheels[0])]
    if args.constraints:
        deps[4:4] = ["-c", args.constraints]
    subprocess.run(deps, check=True)
    print(f"llama-cpp-python {VERSION} installed from {wheels[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
