"""A causal LM's forward over a static KV cache, compiled with inductor once per row count: the CPU serving runtime.

Why: plain decoding forwards 1 row, speculative verification 2..K+1 rows. Eager fp32 on a CPU runs one row with
matrix-vector kernels and several rows with matrix-matrix kernels, and on some machines verifying 2-5 rows cost
1.4-2x a decode step, more than a drafter saves. Inductor with frozen weights compiles each row count into its own
kernels over constant (pre-packed) weights, and the decode step itself gets faster.

How:

- ``CompiledCausalLM(model, max_rows=K + 1, max_cache_len=...)`` wraps a causal LM (Llama-like, transformers >= 5.24).
  It quacks like the model for the serving loop (``config``, ``parameters()``, ``generation_config``, ``__call__``),
  and ``new_cache()`` gives a transformers ``StaticCache`` of ``max_cache_len`` positions, allocated up front.
- A call with ``q <= max_rows`` rows over such a cache runs the compiled graph for ``q`` rows (static shapes, one
  graph per ``q``); longer calls (the prompt's prefill) run eagerly over the same cache.
- ``warm_up()`` compiles every row count with a progress bar. After it, every compiled call runs under
  ``torch.compiler.set_stance("fail_on_recompile")``: a recompilation inside the served loop is an error, not a
  silent minute-long stall.
- Inductor's on-disk cache lives under ``cache_root() / "inductor" / <key>``, the key naming torch's version, the CPU's
  instruction sets, the thread count and the settings (inductor's own key does not name the CPU).
- Rolling back after a rejected window is ``crop_cache``: a static cache only moves its length back; the stale rows
  are masked, then overwritten.

``CompileSettings`` holds the inductor options; ``benchmarks/compiled_runtime_settings.py`` measures them (cold and
warm compile seconds, t_t, t_v(L)) to choose the defaults.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch._inductor.config

from .utils import cache_root, cpu_flags

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileSettings:
    """Inductor options of the compiled runtime.

    Attributes:
        freezing: weights become constants, folded and pre-packed for the CPU GEMM kernels (needs ``no_grad``).
        max_autotune: benchmark GEMM implementations per shape (slower to compile; C++ GEMM templates need it).
        gemm_backends: ``max_autotune_gemm_backends``, e.g. ``"CPP,ATEN"``.
        extra: more inductor options, passed as they are.
    """

    freezing: bool = True
    max_autotune: bool = False
    gemm_backends: str = "CPP,ATEN"
    extra: dict = field(default_factory=dict)

    def options(self) -> dict:
        options = {"freezing": self.freezing, "max_autotune": self.max_autotune, **self.extra}
        if self.max_autotune:
            options["max_autotune_gemm_backends"] = self.gemm_backends
        return options

    def label(self) -> str:
        parts = ["freezing" if self.freezing else "no-freezing"]
        if self.max_autotune:
            parts.append(f"max-autotune[{self.gemm_backends}]")
        parts += [f"{k}={v}" for k, v in sorted(self.extra.items())]
        return "+".join(parts)


def compile_cache_dir(settings: CompileSettings, root: Path | None = None) -> Path:
    """``cache_root()/inductor/<key>``: one inductor cache per torch build, CPU instruction sets, threads, settings."""
    key = {"torch": torch.__version__, "cpu": sorted(cpu_flags()), "threads": torch.get_num_threads(),
           "settings": asdict(settings)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return (root or cache_root()) / "inductor" / digest


def use_compile_cache(settings: CompileSettings) -> Path:
    """Point inductor's on-disk cache at ``compile_cache_dir(settings)`` (unless ``TORCHINDUCTOR_CACHE_DIR`` is set by
    the user) before anything compiles; returns the folder in use."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") and not os.environ.get("PPOW_TRL_INDUCTOR_CACHE_SET"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    folder = compile_cache_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ["PPOW_TRL_INDUCTOR_CACHE_SET"] = "1"
    return folder


class CompiledCausalLM(torch.nn.Module):
    """``model``'s forward compiled per row count ``1..max_rows`` over a static KV cache (module docstring)."""

    def __init__(self, model, *, max_rows: int, max_cache_len: int = 1024,
                 settings: CompileSettings | None = None):
        super().__init__()
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
        self.model = model.eval()
        self.max_rows, self.max_cache_len = int(max_rows), int(max_cache_len)
        self.settings = settings or CompileSettings()
        self.cache_dir = use_compile_cache(self.settings)
        # One compiled function; dynamo compiles one graph per row count (dynamic=False) and guards on the shape.
        # Every graph of every compiled model shares dynamo's per-code recompile limit (8 by default).
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * (self.max_rows + 2))
        # The settings go through inductor's global config, patched around every call (compiling happens at the
        # first call of each shape): passed as torch.compile(options=...), max-autotune's C++ GEMM template was never
        # chosen (SmolLM2's lm head: 9.7/24.0/35.7 ms for 1/2/3 rows either way, 4.5/4.2/3.8 ms with the config set).
        self._compiled = torch.compile(self.model, fullgraph=True, dynamic=False)
        self.warm = False
        self.compile_seconds: float | None = None
        self._cache = None

    # --- everything else the serving loop reads (config, generation_config, get_output_embeddings, ...) -----------
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def new_cache(self):
        """The runtime's ``StaticCache`` of ``max_cache_len`` positions, emptied: one sequence at a time. Allocated
        once, outside any compiled graph; reusing it keeps the compiled graphs' guards on one object."""
        if self._cache is not None:
            self._cache.crop(-int(self._cache.get_seq_length()))
            return self._cache
        from transformers import StaticCache

        config = self.model.config.get_text_config()
        cache = StaticCache(config=config, max_cache_len=self.max_cache_len)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        cache.early_initialization(1, heads, head_dim, self.model.dtype, self.model.device)
        self._cache = cache
        return cache

    def forward(self, input_ids=None, position_ids=None, cache=None, **kwargs):
        rows = input_ids.shape[-1]
        if cache is None:
            cache = self.new_cache()
        length = int(cache.get_seq_length())
        if length + rows > self.max_cache_len:
            raise ValueError(f"The static cache holds {self.max_cache_len} positions; {length} + {rows} do not fit. "
                             "Build the runtime with a larger max_cache_len.")
        if rows > self.max_rows or kwargs.get("output_hidden_states") or kwargs.get("logits_to_keep", 0):
            # the prompt's prefill (and feature reads): eager, over the same cache
            return self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, **kwargs)
        kwargs.pop("logits_to_keep", None)
        # Fresh standard strides: dynamo guards on strides, and a slice of a longer tensor would recompile.
        input_ids = input_ids.reshape(1, rows).clone(memory_format=torch.contiguous_format)
        position_ids = (torch.arange(length, length + rows, device=input_ids.device).unsqueeze(0)
                        if position_ids is None else position_ids.reshape(1, rows).clone(memory_format=torch.contiguous_format))
        return self._call_compiled(input_ids, position_ids, cache)

    def _call_compiled(self, input_ids, position_ids, cache):
        """The compiled graph of this row count; after ``warm_up`` a shape it did not compile is an error."""
        stance = torch.compiler.set_stance("fail_on_recompile") if self.warm else contextlib.nullcontext()
        with torch.no_grad(), stance, torch._inductor.config.patch(self.settings.options()):
            return self._compiled(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)

    @torch.no_grad()
    def warm_up(self, progress: bool = True) -> float:
        """Compile every row count ``1..max_rows`` (from inductor's disk cache when it holds them); seconds taken."""
        from tqdm.auto import tqdm

        started = time.perf_counter()
        cache = self.new_cache()
        token = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)
        bar = tqdm(range(1, self.max_rows + 1), desc=f"Compiling {type(self.model).__name__} ({self.settings.label()})",
                   unit="shape", disable=not progress)
        for rows in bar:
            ids = token.repeat(1, rows)
            positions = torch.arange(rows, device=ids.device).unsqueeze(0)
            self._call_compiled(ids, positions, cache)
            cache.crop(-rows)
        self.warm = True
        self.compile_seconds = time.perf_counter() - started
        logger.info("Compiled %d shapes in %.0f s (inductor cache %s)", self.max_rows, self.compile_seconds,
                    self.cache_dir)
        return self.compile_seconds
