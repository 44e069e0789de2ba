"""The inductor settings of the compiled runtime, where its compiled code is cached, and what compiling runs under.

``CompileSettings`` names the options (freezing, max-autotune and its GEMM backends, row independence, packages);
``compile_cache_dir`` keys the on-disk cache by torch's version, the CPU's instruction sets, the thread count and the
settings; ``compile_context`` is the one place that applies them while inductor compiles (in the serving process, or
in a package build's worker process: ``ppow_trl.compiled_runtime.packaged``).
``benchmarks/compiled_runtime_settings.py`` measures the settings (cold and warm compile seconds, t_t, t_v(L)) to choose
the defaults.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

import torch
import torch._inductor.config

from ..utils import cache_root, cpu_flags


@dataclass(frozen=True)
class CompileSettings:
    """Inductor options of the compiled runtime.

    Attributes:
        freezing: weights become constants, folded and pre-packed for the CPU GEMM kernels (needs ``no_grad``).
        max_autotune: benchmark GEMM implementations per shape (slower to compile; C++ GEMM templates need it).
            On by default: on SmolLM2 fp32 (AMD EPYC, AVX-512) it made the decode step 2.1x faster than eager and a
            2-4 row verify cost 0.96-1.03 steps; freezing alone gained 1.1x and kept eager's 1.6-2x verify costs
            (benchmarks/results/compiled_runtime_settings.md).
        gemm_backends: ``max_autotune_gemm_backends``; ``None`` (the default): ``"CPP"`` with ``row_independent``,
            else ``"CPP,ATEN"``. Why only the C++ template for row independence: max-autotune picks the fastest
            kernel per shape by timing, and where it picked ATen's GEMM for one row count (SmolLM2 fp32, 5 rows, 2 of
            the layers' GEMMs) that graph's rows differed from the decode step's in every row: the C++ template
            gives a row the same bits whatever the row count, but only if every row count runs it.
        row_independent: compile so that a row's logits do not depend on how many rows one call scores, so that
            greedy speculative decoding gives plain decoding's tokens bitwise, by construction, at every precision
            (module docstring): attention padded to ``max_rows`` query rows in every graph
            (``ppow_trl.compiled_runtime.attention``) and inductor's ``emulate_precision_casts``. On by default:
            lossless by construction is worth its cost (SmolLM2, AMD EPYC, 1 thread, benchmarks/row_independence.py:
            the decode step about 1.1x as long, a 2-5 row verify 0.90-1.01x). Off: the graphs PyTorch's own attention
            gives, whose verify rows differed from the decode steps' in the last bits.
        packaged: keep each graph as an AOTInductor package on disk (``ppow_trl.compiled_runtime.packaged``), loaded in
            seconds by the next process, instead of ``torch.compile``'s graphs, which every process traces and
            freezes again before inductor's disk cache answers (SmolLM2 fp32, 5 row counts, AMD EPYC: 274 s warm).
            Where exporting fails, the runtime says so in one line and compiles with ``torch.compile``.
        extra: more inductor options, passed as they are.
    """

    freezing: bool = True
    max_autotune: bool = True
    gemm_backends: str | None = None
    row_independent: bool = True
    packaged: bool = True
    extra: dict = field(default_factory=dict)

    @property
    def backends(self) -> str:
        """``gemm_backends`` as used (its docstring)."""
        return self.gemm_backends or ("CPP" if self.row_independent else "CPP,ATEN")

    def options(self) -> dict:
        options = {"freezing": self.freezing, "max_autotune": self.max_autotune, **self.extra}
        if self.row_independent:
            # Round bf16 values where the graph says so, also inside fused kernels: which ops fuse depends on the row
            # count (a 6-layer int8 Llama with a fp32 stream and padded attention: every verified row differed from
            # the decode step's without it, none with it, for 0.2 ms a step).
            options["emulate_precision_casts"] = True
        if self.max_autotune:
            options["max_autotune_gemm_backends"] = self.backends
        return options

    def label(self) -> str:
        parts = ["freezing" if self.freezing else "no-freezing"]
        if self.max_autotune:
            parts.append(f"max-autotune[{self.backends}]")
        if self.row_independent:
            parts.append("row-independent")
        if self.packaged:
            parts.append("packaged")
        parts += [f"{k}={v}" for k, v in sorted(self.extra.items())]
        return "+".join(parts)


KEY_FILE = "key.json"
"""What an inductor cache folder was keyed on, written in it (``use_compile_cache``): ``ppow_trl.caches`` reads it to
tell the folders of another torch build or CPU (stale) from current ones."""


def compile_cache_key(settings: CompileSettings) -> dict:
    """What one inductor cache serves: the torch build, the CPU's instruction sets, the threads and the settings."""
    return {"torch": torch.__version__, "cpu": sorted(cpu_flags()), "threads": torch.get_num_threads(),
            "settings": asdict(settings)}


def compile_cache_dir(settings: CompileSettings, root: Path | None = None) -> Path:
    """``cache_root()/inductor/<key>``: one inductor cache per torch build, CPU instruction sets, threads, settings."""
    key = compile_cache_key(settings)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return (root or cache_root()) / "inductor" / digest


def use_compile_cache(settings: CompileSettings) -> Path:
    """Point inductor's on-disk cache at ``compile_cache_dir(settings)`` before anything compiles, unless the user
    chose a folder with ``TORCHINDUCTOR_CACHE_DIR``; returns the folder in use.

    Inductor writes its default (``/tmp/torchinductor_<user>``) into ``TORCHINDUCTOR_CACHE_DIR`` the first time it
    asks for its cache folder, so a value equal to that default is not a user's choice: left alone, the compiled
    graphs went to /tmp, which a reboot or a fresh machine empties."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    ours = os.environ.get("PPOW_TRL_INDUCTOR_CACHE_SET")
    if current and not ours and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return Path(current)
    folder = compile_cache_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / KEY_FILE).exists():
        with contextlib.suppress(OSError):
            (folder / KEY_FILE).write_text(json.dumps(compile_cache_key(settings), sort_keys=True, default=str))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["PPOW_TRL_INDUCTOR_CACHE_SET"] = "1"
    return folder


@contextlib.contextmanager
def compile_context(settings: CompileSettings):
    """What compiling runs under: ``settings`` in inductor's global config, and MKL's weight packing off.

    Why MKL off: with ``freezing``, inductor packs fp32 linear weights for MKL (``mkl._mkl_reorder_linear_weight``),
    an opaque tensor that its FX graph cache cannot key ("mkldnn tensors unpickleable"), so every process compiled
    every graph again (SmolLM2, 5 shapes: a 307 s "warm" start). With the pass off the C++ GEMM template (which packs
    its own weights) is still chosen, and the graphs come back from the disk cache (a tiny Llama: 67 s cold, 4.9 s
    warm). Only compiling sees the flag; the compiled kernels and eager code do not read it.

    Why the templates are memoized (``_parsed_template``): inductor parses the Jinja source of its C++ GEMM template
    again for every GEMM it renders (a new ``jinja2.Environment`` each time, 6,260 parses for one SmolLM2 package),
    which was 99 of the 339 s of one cold package build (cProfile, AMD EPYC, beside another job). The same source gives
    the same template, so the generated code is unchanged.
    """
    import torch._inductor.select_algorithm as select_algorithm
    from torch._inductor.codegen.common import KernelTemplate

    _inductors_template_parser()

    with torch._inductor.config.patch(settings.options()), mock.patch.object(torch._C, "has_mkl", False), \
            mock.patch.object(select_algorithm, "PRINT_AUTOTUNE", False), \
            mock.patch.object(KernelTemplate, "_template_from_string", staticmethod(_parsed_template)), \
            warnings.catch_warnings():
        # Quiet: max-autotune prints a table per GEMM (hundreds) over the warm-up's progress bar (not part of the
        # cache key, unlike inductor's config), and inductor's own use of a deprecated storage API warns.
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


@functools.lru_cache(maxsize=None)
def _inductors_template_parser():
    from torch._inductor.codegen.common import KernelTemplate

    return KernelTemplate.__dict__["_template_from_string"].__func__  # read before compile_context replaces it


@functools.lru_cache(maxsize=512)
def _parsed_template(source: str):
    """inductor's ``KernelTemplate._template_from_string``, parsed once per source (``compile_context``)."""
    return _inductors_template_parser()(source)
