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
- ``warm_up()`` compiles every row count with a progress bar. By default (``CompileSettings.packaged``) each row
  count's graph is an AOTInductor package on disk (``ppow_trl.compiled_runtime.packaged``): the first process builds it,
  the next ones load it in seconds, and nothing can compile inside the served loop (a row count without a package is an
  error after the warm-up). With ``packaged=False`` (or a model ``torch.export`` cannot take), ``torch.compile``
  traces the graphs in every process, and after the warm-up every call runs under
  ``torch.compiler.set_stance("fail_on_recompile")``.
- The on-disk caches (packages, inductor's kernels and autotuning) live under ``cache_root() / "inductor" / <key>``,
  the key naming torch's version, the CPU's instruction sets, the thread count and the settings (inductor's own key
  does not name the CPU).
- The packages take disk (about twice the weights' bytes each, a set per weight set): the store keeps the least
  recently used sets under ``$PPOW_TRL_PACKAGE_STORE_GB`` and a build that the disk cannot hold stops before compiling
  with ``NotEnoughDisk`` (``ppow_trl.compiled_runtime.package_store``), which ``serving_runtime`` serves eagerly after.
- A row's logits must not depend on how many rows one call scores, or speculation could pick another token than
  plain decoding at a near tie. Left to itself, inductor lowers attention for one query row into a product and a sum
  but for several rows into a GEMM (two summation orders), and at low precision it rounds an intermediate only where
  a kernel stores it, while which ops fuse depends on the row count: on SmolLM2 every verified row differed from the
  decode step's in its last bits. ``CompileSettings(row_independent=True)`` (the default) removes both causes
  (``ppow_trl.compiled_runtime.attention``'s attention padded to ``max_rows`` query rows in every graph, inductor's
  ``emulate_precision_casts``); the GEMMs of the linear layers (C++ templates) already gave every row the same bits
  whatever the row count. A verify pass's rows are then bitwise the decode steps'.
- Inductor still chooses kernels per shape (on an AMX CPU its int8 GEMM switches kernel at 5 rows), so after the
  warm-up ``ppow_trl.compiled_runtime.row_check`` checks every graph's rows bitwise against the decode step and, where
  one differs, splits such calls over graphs that agree or runs every call on the largest graph (``row_plan``).
- A drafter that reads the target's hidden states (EAGLE-3, DFlash) needs them from every verify pass:
  ``CompiledCausalLM(..., feature_layers=ids)`` makes every graph return ``cat(hidden_states[i] for i in ids)`` next
  to the logits (``out.features`` of a call with ``return_features=True``: ``ppow_trl.features.target_forward``), so
  the verify pass that scores a window also hands the drafter its features, as on the eager route. The graphs are
  others than a plain target's (their packages are keyed by the layer ids).
- Rolling back after a rejected window is ``crop_cache``: a static cache only moves its length back; the stale rows
  are masked, then overwritten.

``CompileSettings`` (``ppow_trl.compiled_runtime.inductor_settings``) holds the inductor options;
``benchmarks/compiled_runtime_settings.py`` measures them (cold and warm compile seconds, t_t, t_v(L)) to choose the
defaults.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import weakref
from pathlib import Path

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..features import select_features
from ..utils import interleaved_medians
from .attention import fixed_rows_attention
from .inductor_settings import CompileSettings, compile_cache_dir, compile_context, use_compile_cache
from .package_store import (build_bytes, disk_full, make_room, mark_used, package_bytes, package_path,
                            remove_stale_build_files, store_budget_bytes)
from .packaged import build_packages, build_workers, cache_state, load_package, weights_digest, write_build_info
from .row_check import RowPlan, choose_row_plan, split_rows

__all__ = ["CompileSettings", "CompiledCausalLM", "compile_cache_dir", "compile_context", "use_compile_cache"]

logger = logging.getLogger(__name__)


_STATIC_CACHES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
"""model -> {max_cache_len: StaticCache}: the one static cache of each model and length (``new_cache``)."""
_SETTINGS: "weakref.WeakKeyDictionary[torch.nn.Module, CompileSettings]" = weakref.WeakKeyDictionary()
"""model -> the settings its torch.compile graphs were compiled with in this process."""
_PACKAGES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
"""model -> {package path: loaded package}: each package loaded once per process (runtimes over one model share)."""


_MUTABLE_REGISTRIES = ("_CAN_RECORD_REGISTRY",)
"""Process-wide registries the traced forward reads and that grow when any model class is instantiated later
(transformers' output-capturing registry, keyed by class name). Dynamo guards on their length, so loading another
model after the warm-up (a drafter, a second target) failed every guard: a recompile, an error under
``fail_on_recompile``. The entry of the compiled model's own class never changes, so those guards are dropped."""


_HAS_GUARD_FILTER = hasattr(torch.compiler, "skip_guard_on_globals_unsafe")
"""torch.compile takes ``options={"guard_filter_fn": ...}`` (the release that added it also added the public helper
filters such as ``torch.compiler.skip_guard_on_globals_unsafe``); older versions would pass it to inductor as an
unknown option. (``torch._dynamo.optimize``'s signature is ``*args, **kwargs``: it cannot tell.)"""


def _skip_registry_guards(guard_entries) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: keep every guard but those on ``_MUTABLE_REGISTRIES``."""
    return [not any(name in entry.name for name in _MUTABLE_REGISTRIES) for entry in guard_entries]


class CompiledCausalLM(torch.nn.Module):
    """``model``'s forward compiled per row count ``1..max_rows`` over a static KV cache (module docstring)."""

    def __init__(self, model, *, max_rows: int, max_cache_len: int = 1024,
                 settings: CompileSettings | None = None, decode_rows: int | None = None, verifies: bool = True,
                 feature_layers: list[int] | None = None):
        super().__init__()
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}.")
        if verifies and max_rows > 1 and max_cache_len < 2 * max_rows + 1:
            raise ValueError(f"max_cache_len={max_cache_len} leaves no room to check the {max_rows}-row graphs against "
                             f"decode steps at the warm-up: use max_cache_len >= {2 * max_rows + 1}.")
        if decode_rows not in (None, 1, 2) or (decode_rows == 2 and max_rows < 2):
            raise ValueError(f"decode_rows must be None (measured at the warm-up), 1, or 2 with max_rows >= 2; got "
                             f"{decode_rows!r} with max_rows={max_rows}.")
        # The graph a one-token step runs: its own (1), or the 2-row graph with a padding row (2), whose row 0 is
        # bitwise the 1-row graph's (row-independent graphs) and ran 20% faster on one machine; None: measured.
        self.decode_rows = decode_rows
        # Which graphs calls run: each its own, unless the warm-up found some graph's rows not bitwise the one-token
        # step's on this machine; then calls of that row count are split over graphs that agree, or every call runs
        # the max_rows graph (``ppow_trl.compiled_runtime.row_check``), so that speculation stays lossless whatever
        # kernels inductor chose per shape.
        self.row_plan = RowPlan()
        # Only a verifier's rows must match its decode steps: a drafter's rows that differ change what it proposes
        # (SmolLM2's fp32 2-layer drafter's 2-row graph did, on the AMX Xeon), never the output, so it is not checked.
        self.verifies = verifies
        # The hidden states (``output_hidden_states`` indices) every graph returns next to the logits, for a drafter
        # that reads them (module docstring); None: logits only.
        self.feature_layers = None if feature_layers is None else [int(i) for i in feature_layers]
        if self.feature_layers is not None:
            depth = model.config.get_text_config().num_hidden_layers
            if not self.feature_layers or min(self.feature_layers) < 0 or max(self.feature_layers) > depth:
                raise ValueError(f"feature_layers {feature_layers} must index the target's {depth + 1} hidden states "
                                 f"(0 = embeddings, i = decoder layer i - 1).")
        self.model = model.eval()
        self.max_rows, self.max_cache_len = int(max_rows), int(max_cache_len)
        self.settings = settings or CompileSettings()
        self.cache_dir = use_compile_cache(self.settings)
        self._compiled = None  # the torch.compile'd model; None while packages serve (``packaged``)
        self._packages: dict[int, object] = {}  # rows -> loaded package (packaged)
        self._digest: str | None = None
        self.packages_built = 0  # packages compiled (not loaded from disk) by this runtime
        self.build_workers = 0  # how many of them were built at once (processes), the last time any were
        if self.settings.packaged:
            store_budget_bytes()  # a bad $PPOW_TRL_PACKAGE_STORE_GB: a clear error now, not a fallback in the warm-up
        else:
            self._compile_with_dynamo()
        self.warm = False
        self.compile_seconds: float | None = None

    def _compile_with_dynamo(self):
        """``torch.compile`` the model (``settings.packaged=False``, or a model that could not be exported)."""
        # Dynamo's guards do not see inductor's settings: a second runtime over this model with other settings would
        # run the first one's graphs. One set of settings per model in a process (torch._dynamo.reset() to change).
        first = _SETTINGS.setdefault(self.model, self.settings)
        if first != self.settings:
            raise ValueError(f"This model was already compiled with {first.label()} in this process; a runtime with "
                             f"{self.settings.label()} would run those graphs. Use the same settings, or call "
                             "torch._dynamo.reset() and compile again.")
        # One compiled function; dynamo compiles one graph per row count (dynamic=False) and guards on the shape.
        # Every graph of every compiled model shares dynamo's per-code recompile limit (8 by default): each runtime
        # made in a process adds its row counts to it (a test process that built six runtimes hit a fixed limit of 24
        # and served eagerly; after the warm-up a recompile is an error anyway).
        torch._dynamo.config.recompile_limit = (max(torch._dynamo.config.recompile_limit, 4 * (self.max_rows + 2))
                                                + self.max_rows + 2)
        # The settings go through inductor's global config, patched around every call (compiling happens at the
        # first call of each shape): passed as torch.compile(options=...), max-autotune's C++ GEMM template was never
        # chosen (SmolLM2's lm head: 9.7/24.0/35.7 ms for 1/2/3 rows either way, 4.5/4.2/3.8 ms with the config set).
        if self.feature_layers is not None:
            # transformers collects hidden states with forward hooks it installs at the first call that asks for them
            # (under a lock, which a fullgraph trace cannot take): install them here, eagerly, before any trace
            with torch.no_grad():
                self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.model.device),
                           output_hidden_states=True)
        self._compiled = torch.compile(self.model, fullgraph=True, dynamic=False,
                                       options={"guard_filter_fn": _skip_registry_guards} if _HAS_GUARD_FILTER else None)

    @property
    def packaged(self) -> bool:
        """Whether AOTInductor packages serve the graphs (else torch.compile: ``settings.packaged=False``, or a
        fallback after packaging failed)."""
        return self._compiled is None

    def label(self) -> str:
        """The settings the graphs were compiled with, as served: ``settings.label()``, naming torch.compile instead
        of packages after a fallback."""
        label = self.settings.label()
        if self.settings.packaged and not self.packaged:
            label = label.replace("packaged", "torch.compile (packaging failed)")
        return label + self.row_plan.describe(self.max_rows)

    # --- everything else the serving loop reads (config, generation_config, get_output_embeddings, ...) -----------
    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def new_cache(self):
        """The runtime's ``StaticCache`` of ``max_cache_len`` positions, emptied: one sequence at a time (a sequence
        in flight on this model is lost: a call with ``cache=None`` starts a new one). Allocated
        once per (model, ``max_cache_len``), outside any compiled graph: dynamo reuses a graph compiled for a model
        with any static cache of the same shape, and that graph writes into the cache it was compiled with (found
        when a second runtime over the same model decoded into the first one's cache), so every runtime over one
        model shares one cache."""
        caches = _STATIC_CACHES.setdefault(self.model, {})
        cache = caches.get(self.max_cache_len)
        if cache is None:
            from transformers import StaticCache

            config = self.model.config.get_text_config()
            heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            with torch.inference_mode(False):  # ordinary tensors: the compiled graphs update them in place
                cache = StaticCache(config=config, max_cache_len=self.max_cache_len)
                cache.early_initialization(1, heads, head_dim, self.model.dtype, self.model.device)
            caches[self.max_cache_len] = cache
        length = int(cache.get_seq_length())
        if length:  # a static layer only crops by a negative count
            cache.crop(-length)
        return cache

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, logits_to_keep=0,
                return_features: bool = False, **kwargs):
        """The model's forward. One unpadded sequence over the runtime's static cache runs the compiled graph of its
        row count (``rows <= max_rows``), else the eager model over the same cache (a prefill, a feature read).
        Batches and caches that are not the runtime's go to the eager model as they are (calibration rollouts).
        ``return_features=True`` (a runtime built with ``feature_layers``): ``out.features`` holds the hidden states
        of those layers, ``(batch, rows, len(feature_layers) * hidden)``, on every route."""
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError("The compiled runtime takes input_ids of shape (batch, tokens) (no inputs_embeds).")
        if return_features and self.feature_layers is None:
            raise ValueError("return_features=True needs a runtime built with feature_layers=.")
        batch, rows = input_ids.shape
        if batch != 1 or (cache is not None and cache is not _STATIC_CACHES.get(self.model, {}).get(self.max_cache_len)):
            return self._eager(return_features, input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, cache=cache, logits_to_keep=logits_to_keep, **kwargs)
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("The compiled runtime serves one unpadded sequence: pass no attention mask (or all ones).")
        if cache is None:
            cache = self.new_cache()
        length = int(cache.get_seq_length())
        if length + rows > self.max_cache_len:
            raise ValueError(f"The static cache holds {self.max_cache_len} positions; {length} + {rows} do not fit. "
                             "Build the runtime with a larger max_cache_len.")
        kwargs.pop("use_cache", None)
        kwargs.pop("return_dict", None)
        if rows > self.max_rows or kwargs or not isinstance(logits_to_keep, int):
            # the prompt's prefill, feature reads (output_hidden_states), index tensors: eager, over the same cache
            return self._eager(return_features, input_ids=input_ids, position_ids=position_ids, cache=cache,
                               use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
        # Fresh standard strides (dynamo guards on strides: a slice of a longer tensor would recompile), made outside
        # inference mode (dynamo guards on dispatch keys: an inference tensor would recompile too).
        with torch.inference_mode(False):
            input_ids = input_ids.reshape(1, rows).clone(memory_format=torch.contiguous_format)
            position_ids = (torch.arange(length, length + rows, device=input_ids.device).unsqueeze(0)
                            if position_ids is None
                            else position_ids.reshape(1, rows).clone(memory_format=torch.contiguous_format))
            if self.row_plan.uniform:
                out = self._uniform_call(input_ids, position_ids, cache, length)
            elif self.row_plan.graphs is not None and rows not in self.row_plan.graphs:
                out = self._split_call(input_ids, position_ids, cache, length)
            else:
                out = self._padded_call(input_ids, position_ids, cache, length, self._graph_rows(rows))
        if 0 < logits_to_keep < rows:
            # One graph per row count computes every row's logits: with the C++ GEMM template the lm head costs
            # about the same for 1 to 3 rows, and a graph per (rows, kept) pair would double the compile time.
            out.logits = out.logits[:, -logits_to_keep:]
        return out

    def _eager(self, return_features: bool, **kwargs):
        """The eager model's forward (``kwargs``), with ``out.features`` of ``feature_layers`` when asked."""
        if not return_features:
            return self.model(**kwargs)
        out = self.model(**kwargs, output_hidden_states=True)
        out.features = select_features(out.hidden_states, self.feature_layers)
        out.hidden_states = None
        return out

    def _padded_call(self, input_ids, position_ids, cache, length: int, graph_rows: int):
        """The ``graph_rows`` graph on these rows plus padding rows, which repeat the last token at the next positions
        and are cropped away as rejected drafts are (the rows' own graph where the padding does not fit)."""
        rows = input_ids.shape[1]
        extra = graph_rows - rows if length + graph_rows <= self.max_cache_len else 0
        if extra:
            steps = torch.arange(1, extra + 1, device=input_ids.device).unsqueeze(0)
            input_ids = torch.cat([input_ids, input_ids[:, -1:].repeat(1, extra)], 1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], 1)
        out = self._call_compiled(input_ids, position_ids, cache)
        if extra:
            cache.crop(-extra)
            out.logits = out.logits[:, :rows]
            if out.features is not None:
                out.features = out.features[:, :rows]
        return out

    def _split_call(self, input_ids, position_ids, cache, length: int):
        """A call of a row count whose graph differs (``row_plan.graphs``): consecutive chunks, each on a graph whose
        rows are the decode step's (``split_rows``), so every row is scored as plain decoding would score it."""
        outs, start = [], 0
        for chunk in split_rows(input_ids.shape[1], self.row_plan.graphs):
            outs.append(self._padded_call(_columns(input_ids, start, start + chunk),
                                          _columns(position_ids, start, start + chunk), cache, length + start,
                                          self._graph_rows(chunk)))
            start += chunk
        return _joined(outs)

    def _uniform_call(self, input_ids, position_ids, cache, length: int):
        """``row_plan.uniform``: every position is scored by the ``max_rows`` graph, except the last ``max_rows - 1`` of the
        cache, where its padding no longer fits: those by the 1-row graph, one at a time. Which graph scores a position
        then depends on the position alone, not on the call, so plain and speculative decoding agree everywhere."""
        rows = input_ids.shape[1]
        head = max(0, min(rows, self.max_cache_len - self.max_rows + 1 - length))

        outs = []
        if head:
            outs.append(self._padded_call(_columns(input_ids, 0, head), _columns(position_ids, 0, head), cache, length,
                                          self.max_rows))
        outs += [self._call_compiled(_columns(input_ids, i, i + 1), _columns(position_ids, i, i + 1), cache)
                 for i in range(head, rows)]
        return _joined(outs)

    def _graph_rows(self, rows: int) -> int:
        """The graph a call of ``rows`` rows runs (without ``row_plan.uniform``): the 2-row graph for a one-token step when
        ``decode_rows == 2``, else its own. Padding rows come after the real ones, which attend causally and so never
        read them."""
        return 2 if rows == 1 and self.decode_rows == 2 else rows

    def _attention(self):
        """The attention the graphs are traced with: padded to ``max_rows`` rows when ``settings.row_independent``."""
        return (fixed_rows_attention(self.model, self.max_rows) if self.settings.row_independent
                else contextlib.nullcontext())

    def _call_compiled(self, input_ids, position_ids, cache):
        """The compiled graph of this row count; after ``warm_up`` a shape it did not compile is an error."""
        if self.packaged:
            run = self._packages.get(input_ids.shape[1])
            if run is None:
                if self.warm:
                    raise RuntimeError(f"No compiled graph for {input_ids.shape[1]} rows after the warm-up (rows "
                                       f"1..{self.max_rows} were compiled).")
                run = self._packages[input_ids.shape[1]] = self._load_or_build(input_ids.shape[1], cache)
            with torch.no_grad():  # a package does not check its inputs: the dtypes it was built for
                outputs = run(input_ids.long(), position_ids.long(), *cache_state(cache))
            logits, features = (outputs[0], outputs[1]) if self.feature_layers is not None else (outputs, None)
            out = CausalLMOutputWithPast(logits=logits, cache=cache)
            out.features = features
            return out
        stance = (torch.compiler.set_stance("fail_on_recompile") if self.warm else compile_context(self.settings))
        with torch.no_grad(), self._attention(), stance:
            if self.feature_layers is None:
                out = self._compiled(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True)
                out.features = None
                return out
            out = self._compiled(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=True,
                                 output_hidden_states=True)
        out.features = select_features(out.hidden_states, self.feature_layers)
        out.hidden_states = None
        return out

    def _package_path(self, rows: int) -> Path:
        if self._digest is None:
            # the weights and the code the graph was traced from, and the settings' key: a folder the user chose
            # with TORCHINDUCTOR_CACHE_DIR does not name the settings, torch, the CPU or the threads
            self._digest = f"{compile_cache_dir(self.settings).name}-{weights_digest(self.model)}" + (
                "" if self.feature_layers is None else "-features" + ".".join(map(str, self.feature_layers))
                + "-" + _source_digest(select_features))  # the feature graphs also trace select_features
        return package_path(self.cache_dir, self._digest, rows, self.max_rows, self.max_cache_len)

    def _build_packages(self, rows: list[int], cache, progress: bool = False) -> None:
        """Build the packages of ``rows`` that the disk does not hold, several at once where the machine allows
        (``ppow_trl.compiled_runtime.packaged.build_workers``), with a progress bar."""
        from tqdm.auto import tqdm

        paths = {q: self._package_path(q) for q in rows}
        missing = {q: path for q, path in paths.items() if not path.exists()}
        if not missing:
            return
        package_set = next(iter(missing.values())).parent
        remove_stale_build_files(package_set)
        model_bytes = sum(t.numel() * t.element_size() for t in itertools.chain(self.model.parameters(),
                                                                               self.model.buffers()))
        workers = self.build_workers = build_workers(len(missing), model_bytes)
        mark_used(package_set)  # in use: no other process removes it while this one builds
        write_build_info(package_set)  # what `python -m ppow_trl.caches scan` checks it against later
        # before any compiling: room on the disk, made by removing unused package sets, or a clear error
        make_room(package_set, keep=package_bytes(model_bytes, len(missing)),
                  peak=build_bytes(model_bytes, len(missing), workers))
        with tqdm(total=len(missing), unit="package", disable=not progress,
                  desc=f"Building {type(self.model).__name__} packages ({self.label()}, {workers} at once)") as bar:
            def built(_rows):
                self.packages_built += 1
                bar.update()

            try:
                build_packages(self.model, cache, missing, self.settings, attention=self._attention,
                               workers=workers, on_built=built, feature_layers=self.feature_layers)
            except Exception as error:  # noqa: BLE001 - a worker's failure (memory, environment): once more here
                if workers == 1:
                    raise
                logger.warning("Building packages in %d worker processes failed (%s: %s); building the rest one at a "
                               "time in this process.", workers, type(error).__name__,
                               str(error).splitlines()[0][:200] if str(error) else "")
                self.build_workers = 1
                build_packages(self.model, cache, {q: path for q, path in missing.items() if not path.exists()},
                               self.settings, attention=self._attention, workers=1, on_built=built,
                               feature_layers=self.feature_layers)

    def _load_or_build(self, rows: int, cache):
        """The package of this row count, loaded once per process and model; built first when the disk has none."""
        path = self._package_path(rows)
        loaded = _PACKAGES.setdefault(self.model, {})
        if path not in loaded:
            self._build_packages([rows], cache)
            mark_used(path.parent)  # before loading: the store removes the least recently used sets, never one in use
            loaded[path] = load_package(path)
        return loaded[path]

    @torch.no_grad()
    def warm_up(self, progress: bool = True) -> float:
        """Compile every row count ``1..max_rows``, or load it from the disk cache; seconds taken. Packages that cannot
        be built (a model ``torch.export`` cannot take) are said in one line, and torch.compile compiles instead."""
        started = time.perf_counter()
        try:
            self._warm_every_row_count(progress)
        except Exception as error:  # noqa: BLE001 - any failure to package: torch.compile instead, said once
            if not self.packaged or disk_full(error):  # torch.compile would fill the same disk
                raise
            logger.warning("AOTInductor packaging failed (%s: %s); compiling with torch.compile instead (every process "
                           "then compiles again).", type(error).__name__,
                           str(error).splitlines()[0][:200] if str(error) else "")
            self._packages.clear()
            _PACKAGES.pop(self.model, None)  # packages loaded before the failure: not served, not kept in memory
            self._compile_with_dynamo()
            self._warm_every_row_count(progress)
        if self.decode_rows is None:
            self.decode_rows = self._faster_decode_rows()
        if self.verifies and self.settings.row_independent and self.max_rows > 1:
            choose_row_plan(self, self._step_seconds)  # sets row_plan: every row as the decode step scores it
        self.warm = True
        self.compile_seconds = time.perf_counter() - started
        logger.info("Compiled %d shapes in %.0f s (inductor cache %s)", self.max_rows, self.compile_seconds,
                    self.cache_dir)
        return self.compile_seconds

    def _faster_decode_rows(self, margin: float = 0.97) -> int:
        """1 or 2: the graph a one-token step should run, timed here; the 2-row graph only when it is faster by the
        ``margin``, else the decode step's own."""
        if self.max_rows < 2 or self.max_cache_len < 34:
            return 1
        seconds = self._step_seconds([1, 2])
        logger.info("One-token step: %.1f ms on its own graph, %.1f ms on the 2-row graph with a padding row; %s",
                    seconds[1] * 1e3, seconds[2] * 1e3, "padding" if seconds[2] < margin * seconds[1] else
                    "its own graph")
        return 2 if seconds[2] < margin * seconds[1] else 1

    def _step_seconds(self, graphs: list[int], repeats: int = 15, context: int = 32) -> dict[int, float]:
        """Median seconds of a one-token step on each graph of ``graphs`` (padding rows after it), timed interleaved,
        ``repeats`` each, at a ``context``-position cache (shorter where the cache is)."""
        context = max(1, min(context, self.max_cache_len - max(graphs)))
        cache = self.new_cache()
        token = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)

        def step(rows):
            def run():
                self._call_compiled(token.repeat(1, rows),
                                    torch.arange(context, context + rows, device=token.device).unsqueeze(0), cache)
                cache.crop(-rows)
            return run

        with torch.no_grad():
            self.model(input_ids=token.repeat(1, context), cache=cache, use_cache=True)
            medians = interleaved_medians({rows: step(rows) for rows in graphs}, repeats=repeats, warmup=2,
                                          device=token.device)
        self.new_cache()
        return medians

    def _warm_every_row_count(self, progress: bool) -> None:
        """Run each row count once over the static cache (compiling, building or loading its graph), a bar per shape."""
        from tqdm.auto import tqdm

        cache = self.new_cache()
        if self.packaged:
            self._build_packages(list(range(1, self.max_rows + 1)), cache, progress)
        token = torch.zeros((1, 1), dtype=torch.long, device=self.model.device)
        what = "Loading" if self.packaged else "Compiling"
        bar = tqdm(range(1, self.max_rows + 1), desc=f"{what} {type(self.model).__name__} ({self.label()})",
                   unit="shape", disable=not progress)
        for rows in bar:
            ids = token.repeat(1, rows)
            self._call_compiled(ids, torch.arange(rows, device=ids.device).unsqueeze(0), cache)
            cache.crop(-rows)


def _source_digest(function) -> str:
    """A short hash of ``function``'s source: part of a package's key where its graph traces that code."""
    import hashlib
    import inspect

    return hashlib.blake2b(inspect.getsource(function).encode(), digest_size=4).hexdigest()


def _columns(tensor, start: int, stop: int):
    """``tensor[:, start:stop]`` with standard strides, as the graphs were traced with."""
    return tensor[:, start:stop].clone(memory_format=torch.contiguous_format)


def _joined(outs):
    """The last call's output, its logits those of every call in order (one call's rows split over several)."""
    out = outs[-1]
    if len(outs) > 1:
        out.logits = torch.cat([o.logits for o in outs], dim=1)
        if out.features is not None:
            out.features = torch.cat([o.features for o in outs], dim=1)
    return out
