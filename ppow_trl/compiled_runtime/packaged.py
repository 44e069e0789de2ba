"""The compiled runtime's graphs as AOTInductor packages on disk: a warm start loads them in seconds.

Why: ``torch.compile`` traces, functionalizes and freezes every graph again in each new process before its on-disk
cache can answer (freezing bypasses AOTAutograd's cache): SmolLM2 fp32, 5 row counts, a filled cache, AMD EPYC:
274 s, every time a job starts. An AOTInductor package (``torch._inductor.aoti_compile_and_package``) is the finished
graph: its kernels, the C++ code that calls them, and the frozen, pre-packed weights. Loading SmolLM2's 5 packages
took 5-10 s on the same machine.

How:

- The forward is exported (``torch.export``, non-strict) as ``CacheStep(input_ids, position_ids, *state)``, where
  ``state`` is the static cache's tensors (``cache_state``: every layer's keys, values and filled length), inputs
  that the graph updates in place. A package holds no cache: it serves the runtime's ``StaticCache``, which the
  eager prefill and ``crop_cache`` share.
- A package embeds the weights, so its name is keyed by them: ``weights_digest`` hashes every parameter and buffer
  (name, dtype, shape, bytes), the model's class, its config without metadata (``CONFIG_METADATA_KEYS``: a drafter
  saved and loaded again keeps its key), transformers' version and the source of this module and of the attention it
  traces. A trained drafter or a converted target gets packages of its own, and a package can never serve weights
  or code other than the ones it was built from. The runtime adds the settings' key (``compile_cache_dir``'s name:
  torch's version, the CPU's instruction sets, the thread count, the inductor settings).
- Only full static caches (``StaticLayer``): a sliding-window layer keeps its length in a Python int that a traced
  graph would freeze; ``export_step`` refuses it, and the runtime compiles with torch.compile instead.
- A package is written under a temporary name and renamed when complete: an interrupted build leaves nothing that a
  later process could load.
- Cold builds run side by side (``build_packages``): this process exports each row count's step, and worker
  processes compile them, as many at once as ``build_workers`` allows (cores over torch's threads, memory;
  ``$PPOW_TRL_BUILD_WORKERS`` to choose). Inductor compiles a graph on one core: SmolLM2 fp32's 5 packages took
  283 s with 3 workers on 2 cores at one thread, 430 s one at a time.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from ..features import select_features
from .inductor_settings import CompileSettings, compile_context
from .package_store import building, remove_build_outputs

logger = logging.getLogger(__name__)

BUILT = 0
"""Packages built (compiled, not loaded) in this process: a served loop must not add to it."""


def cache_state(cache) -> list[torch.Tensor]:
    """A static cache's tensors in the order ``CacheStep`` takes them: keys, values, filled length, per layer."""
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values, layer.cumulative_length)]


class CacheStep(torch.nn.Module):
    """``model``'s forward over ``cache`` with the cache's tensors as arguments: ``(input_ids, position_ids, *state)
    -> logits``, or ``(logits, features)`` with ``feature_layers`` (``select_features`` of those hidden states: what
    a drafter reading the target's hidden states needs from each verify pass). Exported, the graph takes the cache it
    updates as inputs instead of holding one of its own."""

    def __init__(self, model, cache, feature_layers: list[int] | None = None):
        super().__init__()
        self.model = model
        self.cache = cache
        self.feature_layers = feature_layers

    def forward(self, input_ids, position_ids, *state):
        layers = self.cache.layers
        saved = [(layer.keys, layer.values, layer.cumulative_length) for layer in layers]
        for i, layer in enumerate(layers):  # the traced inputs stand in for the cache's own tensors while tracing
            layer.keys, layer.values, layer.cumulative_length = state[3 * i: 3 * i + 3]
        try:
            if self.feature_layers is None:
                return self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache,
                                  use_cache=True).logits
            out = self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True,
                             output_hidden_states=True)
            return out.logits, select_features(out.hidden_states, self.feature_layers)
        finally:
            for layer, tensors in zip(layers, saved):
                layer.keys, layer.values, layer.cumulative_length = tensors


CONFIG_METADATA_KEYS = frozenset({"_name_or_path", "_model_name_or_path", "_commit_hash", "architectures", "auto_map",
                                  "transformers_version", "dtype", "torch_dtype", "use_cache"})
"""Config fields that never change a package's graph (where the model was loaded from, which classes a Hub repo maps
to, the version that saved it; the dtype is the tensors', hashed as such; the runtime always passes ``use_cache``).
A model reloaded from its ``save_pretrained`` folder has other values here than the one that was saved, and must
find the packages built for it."""


def _graph_config(config: dict) -> dict:
    """``config`` without ``CONFIG_METADATA_KEYS``, at every level (a composite config nests its text config)."""
    return {key: _graph_config(value) if isinstance(value, dict) else value for key, value in config.items()
            if key not in CONFIG_METADATA_KEYS}


RUNTIME_SOURCES = (Path(__file__), Path(__file__).with_name("attention.py"))
"""The runtime's own code a graph is traced from: this module's cache step and the attention."""
BUILD_FILE = "build.json"
"""Written in every package set when it is built (``write_build_info``): the code its graphs were traced from.
``ppow_trl.caches`` calls a set stale when that code has changed since (no current key reaches it again)."""


def code_versions() -> dict:
    """The code a package's graphs are traced from, besides the weights: transformers and this runtime's step and
    attention (the same inputs ``weights_digest`` hashes)."""
    import transformers

    source = hashlib.blake2b(digest_size=12)
    for path in RUNTIME_SOURCES:
        source.update(path.read_bytes())
    return {"torch": torch.__version__, "transformers": transformers.__version__, "runtime_code": source.hexdigest()}


def write_build_info(package_set: Path) -> None:
    """Record ``code_versions()`` in ``package_set`` (``BUILD_FILE``), once."""
    path = Path(package_set) / BUILD_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(code_versions(), sort_keys=True))


def weights_digest(model) -> str:
    """A hash of what a package embeds: every parameter and buffer (name, dtype, shape, bytes), the model's class and
    its config without ``CONFIG_METADATA_KEYS``. About a second for SmolLM2's 0.5 GB."""
    import transformers

    digest = hashlib.blake2b(digest_size=12)
    # the code a graph is traced from: transformers' model code, and this runtime's cache step and attention
    digest.update(transformers.__version__.encode())
    for source in RUNTIME_SOURCES:
        digest.update(source.read_bytes())
    digest.update(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    config = getattr(model, "config", None)
    if hasattr(config, "to_diff_dict"):
        digest.update(json.dumps(_graph_config(config.to_diff_dict()), sort_keys=True, default=str).encode())
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def export_step(model, cache, rows: int, attention=None, feature_layers: list[int] | None = None):
    """``CacheStep(model, cache, feature_layers)`` exported for ``rows`` rows (``attention()``: a context manager, the
    attention the graph is traced with).
    The cache's contents are not changed: export traces with fake tensors."""
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {"StaticLayer"}:
        # a sliding-window layer keeps its length in a Python int, which a traced graph would freeze
        raise ValueError(f"Packages serve full static caches only (StaticLayer); this cache has {sorted(kinds)}.")
    device = cache.layers[0].keys.device
    ids = torch.zeros((1, rows), dtype=torch.long, device=device)
    positions = torch.arange(rows, device=device).unsqueeze(0)
    with torch.no_grad(), (attention() if attention else contextlib.nullcontext()):
        return torch.export.export(CacheStep(model, cache, feature_layers).eval(), (ids, positions, *cache_state(cache)),
                                   strict=False)


def compile_exported(exported, path: Path, settings: CompileSettings) -> Path:
    """Compile an exported step into an AOTInductor package at ``path`` under ``settings``, written under a unique
    temporary name and renamed when complete, holding ``building()`` meanwhile (``build_packages`` removes
    AOTInductor's build folders when no build holds it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.partial.pt2")  # unique across processes and hosts
    try:
        with building(Path(cache_dir())), compile_context(settings):
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def build_workers(jobs: int, model_bytes: int) -> int:
    """How many packages to build at once: ``$PPOW_TRL_BUILD_WORKERS`` if set, else the smallest of ``jobs``, one more
    than the cores can run at torch's thread count, and the available memory over ``8 x model_bytes``.

    Why one more than the cores: a build is mostly one core of Python and of one C++ compiler call, this process
    exports the next step meanwhile, and with as many workers as cores the last round of builds left a core idle
    (SmolLM2 fp32, 5 row counts, 2 cores at one thread: one at a time 430 s, 2 workers 355 s, 3 workers 283 s;
    ``benchmarks/compiled_runtime_settings.py``). Why the memory bound: a worker held 3.9 GB at its peak for a
    0.54 GB model (the exported weights, inductor's frozen and packed copies)."""
    chosen = os.environ.get("PPOW_TRL_BUILD_WORKERS", "").strip()
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ValueError(f"PPOW_TRL_BUILD_WORKERS must be a whole number of at least 1, got {chosen!r}.")
        return min(jobs, int(chosen))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_value("cpu.max")  # a container's CPU quota: "<quota> <period>"
    if quota and quota[0] != "max":
        cores = min(cores, max(1, math.ceil(int(quota[0]) / int(quota[1]))))
    try:
        import psutil

        available = psutil.virtual_memory().available
    except ImportError:
        available = 0
    limit = _cgroup_value("memory.max")  # a container's memory limit, which psutil does not see
    if limit and limit[0] != "max":
        used = _cgroup_value("memory.current")
        available = min(available, int(limit[0]) - (int(used[0]) if used else 0))
    memory = int(available // max(1, 8 * model_bytes))
    return max(1, min(jobs, cores // max(1, torch.get_num_threads()) + 1, memory))


def _cgroup_value(name: str) -> list[str] | None:
    """The fields of ``/sys/fs/cgroup/<name>`` (cgroup v2), or ``None`` where there is no such file."""
    try:
        return Path("/sys/fs/cgroup", name).read_text().split() or None
    except (OSError, ValueError):
        return None


def build_packages(model, cache, paths: dict[int, Path], settings: CompileSettings, *, attention=None,
                   workers: int = 1, on_built=None, feature_layers: list[int] | None = None) -> None:
    """Build the package of each row count in ``paths`` (rows -> package path): in this process with ``workers=1``,
    else ``workers`` at a time, each compiled in its own process (``python -c ... _build_in_worker``) from the step
    exported here, while this process exports the next one. Why processes: inductor compiles a graph on one core
    (Python, then one C++ compiler call), so builds side by side use the other cores (``build_workers``).
    ``on_built(rows)`` after each one; ``feature_layers``: ``CacheStep``'s. A failed worker raises ``RuntimeError`` with the end of its output.
    Then AOTInductor's build folders of these packages are removed, unless another build is in progress
    (``remove_build_outputs``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    _build_each(model, cache, paths, settings, attention=attention, workers=workers, on_built=on_built,
                feature_layers=feature_layers)
    try:
        remove_build_outputs([path for path in paths.values() if path.exists()], Path(cache_dir()))
    except Exception as error:  # noqa: BLE001 - the packages are built; a leftover only costs disk
        logger.warning("Could not remove AOTInductor's build folders (%s: %s).", type(error).__name__, error)


def _build_each(model, cache, paths: dict[int, Path], settings: CompileSettings, *, attention=None, workers: int = 1,
                on_built=None, feature_layers: list[int] | None = None) -> None:
    global BUILT
    if workers <= 1:
        for rows, path in paths.items():
            compile_exported(export_step(model, cache, rows, attention, feature_layers), path, settings)
            BUILT += 1
            if on_built:
                on_built(rows)
        return
    settings_json = json.dumps(asdict(settings))  # TypeError for options a worker could not be given
    # The workers import this ppow_trl: its folder goes first on their import path (``python -c`` puts the working
    # folder first, which may hold another checkout; this one need not be installed), and they check that they did.
    package_parent = str(Path(__file__).resolve().parents[2])
    threads = str(torch.get_num_threads())
    processes: set[subprocess.Popen] = set()

    def compile_in_worker(rows: int, exported_file: Path) -> int:
        try:
            process = subprocess.Popen([sys.executable, "-c", _WORKER, package_parent, str(exported_file),
                                        str(paths[rows]), settings_json, threads, str(Path(__file__).resolve())],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            processes.add(process)
            stdout, stderr = process.communicate()
        finally:
            exported_file.unlink(missing_ok=True)
        if process.returncode != 0:
            tail = (stderr or stdout).strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"Building the package for {rows} rows failed in a worker process (exit "
                               f"{process.returncode}): {tail[0][:300]}")
        return rows

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        running: set[concurrent.futures.Future] = set()

        def finish(futures):
            global BUILT
            for future in futures:
                running.discard(future)
                rows = future.result()
                BUILT += 1
                if on_built:
                    on_built(rows)

        try:
            for rows, path in paths.items():
                if len(running) >= workers:  # export the next step only when a worker is free for it
                    finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                    finish(finished)
                path.parent.mkdir(parents=True, exist_ok=True)
                exported_file = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.exported.pt2")
                try:
                    torch.export.save(export_step(model, cache, rows, attention, feature_layers), str(exported_file))
                except BaseException:
                    exported_file.unlink(missing_ok=True)
                    raise
                running.add(pool.submit(compile_in_worker, rows, exported_file))
            finish(concurrent.futures.wait(running).done)
        except BaseException:
            for process in processes:  # a failure (or Ctrl-C) stops the other builds instead of waiting minutes
                process.kill()
            raise


_WORKER = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
           f"from {__name__} import _build_in_worker; _build_in_worker()")  # this module, by its own name


def _build_in_worker() -> None:
    """A worker process of ``build_packages``: ``argv = [exported step, package path, settings JSON, threads, the
    serving process's packaged.py]``."""
    exported_file, path, settings_json, threads, expected = sys.argv[1:6]
    if str(Path(__file__).resolve()) != expected:
        sys.exit(f"This worker imported {Path(__file__).resolve()}, the serving process {expected}: another ppow_trl "
                 "is first on the import path here.")
    torch.set_num_threads(int(threads))  # inductor writes the thread count into the C++ GEMM kernels
    compile_exported(torch.export.load(exported_file), Path(path), CompileSettings(**json.loads(settings_json)))


def load_package(path: Path):
    """The compiled graph in ``path``: ``runner(input_ids, position_ids, *cache_state(cache)) -> logits`` (a
    ``(logits, features)`` tuple for a ``CacheStep`` with ``feature_layers``)."""
    runner = torch._inductor.aoti_load_package(str(path))

    def run(*args):
        out = runner(*args)
        if isinstance(out, (list, tuple)):
            return out[0] if len(out) == 1 else tuple(out)
        return out

    return run
