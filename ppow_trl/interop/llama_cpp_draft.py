"""Our GGUF drafters inside llama.cpp, through llama-cpp-python: the pairing check, and a draft model with our window
rule.

``export_gguf`` writes a standalone drafter as a ``.gguf`` file; llama.cpp is what CPU users serve GGUF models
with. Two ways to pair it with a GGUF target:

- llama.cpp's own programs: ``llama-speculative-simple`` or ``llama-server`` with ``-m target.gguf -md drafter.gguf
  --spec-type draft-simple --spec-draft-n-max K`` (fixed draft lengths, llama.cpp's own draft sampling);
- Python, through llama-cpp-python's speculative hook ``Llama(target, draft_model=...)``: ``LlamaCppDrafter``
  below is that draft model. It runs the exported drafter in llama.cpp and drafts with this project's window rule
  (``AdaptiveWindowPolicy``: ``K``, ``h``, ``T_c`` and the online guard, read from the drafter's saved
  ``ppow_window_policy.json`` or given), greedily.

llama-cpp-python's loop verifies a window in one target forward of ``1 + L`` tokens and keeps the drafted tokens up
to the first one that differs from the token it samples from the target itself, so its output is the target's own
(greedy: token for token; sampled: the same distribution, the sample is the target's), up to llama.cpp's numerics:
a quantized target's multi-token forward is not batch-invariant (Q4_1 SmolLM2: logits up to 0.93 apart from one-token
decoding), so greedy text can part from plain llama.cpp text at near-ties; an f32 file with an f32 KV cache gives
the plain text. Greedy drafts are the right proposals for that rule.

``pairing_problems`` repeats llama.cpp's own compatibility test of a target and a draft model
(``common_speculative_are_compatible`` in ``common/speculative.cpp``; its programs refuse a pair that fails it), read
through llama.cpp's parsing of both files; ``LlamaCppDrafter`` runs it when given the target.

llama-cpp-python is optional: ``pip install llama-cpp-python==0.3.36`` builds llama.cpp from source (about 5 min on
2 CPU cores; ``make llama-cpp``).
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import torch

from ..core.custom_generate.generate import keep_drafting, window_confidence
from .llama_cpp_build import amx_fault_expected, amx_fault_message
from ..utils import default_cpu_threads
from ..core.windowing import WINDOW_POLICY_FILE, AdaptiveWindowPolicy

logger = logging.getLogger(__name__)

LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36  (builds llama.cpp from source; `make llama-cpp`)"

# llama.cpp's common/speculative.cpp: vocabularies may differ in size by this much, and token texts are compared from
# this id on (the first ids are special tokens that tokenizers number differently).
SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128
SPEC_VOCAB_CHECK_START_TOKEN_ID = 5


def require_llama_cpp():
    """``llama_cpp``, or an ImportError that gives the install command."""
    try:
        import llama_cpp
    except ImportError as error:
        raise ImportError(f"llama.cpp's Python bindings are not installed: {LLAMA_CPP_INSTALL}") from error
    return llama_cpp


KV_CACHE_TYPES = {"f16": 1, "f32": 0}
"""ggml type ids of the KV cache: llama.cpp's default f16, or f32 (llama.cpp then computes an f32 model's logits to
fp32 rounding of ours; with f16 they differ by ~5e-3 relative)."""


def load_llama(model_path: str | Path, *, n_ctx: int = 2048, n_threads: int | None = None, logits_all: bool = False,
               kv_cache_type: str = "f16", **llama_kwargs):
    """``llama_cpp.Llama`` on a GGUF file, quiet, on ``n_threads`` CPU threads (default: ``default_cpu_threads()``, as
    for torch), with a fixed seed and a ``kv_cache_type`` KV cache."""
    llama_cpp = require_llama_cpp()
    path = Path(model_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a GGUF file: export one with ppow_trl.export_gguf(drafter, path, ...).")
    if kv_cache_type not in KV_CACHE_TYPES:
        raise ValueError(f"kv_cache_type must be one of {sorted(KV_CACHE_TYPES)}, got {kv_cache_type!r}.")
    threads = int(n_threads or default_cpu_threads())
    kv = KV_CACHE_TYPES[kv_cache_type]
    llama = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                            logits_all=logits_all, seed=0, verbose=False, type_k=kv, type_v=kv, **llama_kwargs)
    if is_quantized(llama) and amx_fault_expected():
        # A clear error now rather than a segmentation fault at the first evaluation (ppow_trl.interop.llama_cpp_build).
        raise RuntimeError(f"{path.name}: {amx_fault_message()}")
    return llama


# llama.cpp's general.file_type values whose matrices are not quantized: ALL_F32, MOSTLY_F16, MOSTLY_BF16.
UNQUANTIZED_FILE_TYPES = {"0", "1", "32"}


def is_quantized(llama) -> bool:
    """Whether the loaded ``llama_cpp.Llama`` may hold quantized matrices: its GGUF's ``general.file_type`` is not
    F32, F16 or BF16 (a file that does not say is taken as quantized)."""
    file_type = (getattr(llama, "metadata", None) or {}).get("general.file_type")
    return file_type is None or str(file_type) not in UNQUANTIZED_FILE_TYPES


def pairing_problems(target, drafter) -> list[str]:
    """Why llama.cpp would refuse ``drafter`` as the draft model of ``target`` (both ``llama_cpp.Llama``); ``[]`` when
    it accepts the pair. The checks of llama.cpp's ``common_speculative_are_compatible``, in its order: the same
    vocabulary type; the same ``add_bos`` (and BOS id when added) and ``add_eos`` (and EOS id); vocabulary sizes
    within 128; the same token text for every id from 5 on."""
    llama_cpp = require_llama_cpp()
    vt, vd = (llama_cpp.llama_model_get_vocab(m.model) for m in (target, drafter))
    kind_t, kind_d = llama_cpp.llama_vocab_type(vt), llama_cpp.llama_vocab_type(vd)
    if kind_t != kind_d:
        return [f"vocabulary type {kind_d} differs from the target's {kind_t} (a drafter exported without a tokenizer "
                "has none): export it with the target's GGUF file or tokenizer, export_gguf(drafter, path, tokenizer)"]
    problems = []
    for name, add, token in (("BOS", llama_cpp.llama_vocab_get_add_bos, llama_cpp.llama_vocab_bos),
                             ("EOS", llama_cpp.llama_vocab_get_add_eos, llama_cpp.llama_vocab_eos)):
        if add(vt) != add(vd) or (add(vt) and token(vt) != token(vd)):
            problems.append(f"{name} differs: the target adds it: {add(vt)}, id {token(vt)}; the drafter adds it: "
                            f"{add(vd)}, id {token(vd)}")
    size_t, size_d = llama_cpp.llama_vocab_n_tokens(vt), llama_cpp.llama_vocab_n_tokens(vd)
    if abs(size_t - size_d) > SPEC_VOCAB_MAX_SIZE_DIFFERENCE:
        problems.append(f"vocabulary sizes {size_d} (drafter) and {size_t} (target) differ by more than "
                        f"{SPEC_VOCAB_MAX_SIZE_DIFFERENCE}")
        return problems
    for token_id in range(SPEC_VOCAB_CHECK_START_TOKEN_ID, min(size_t, size_d)):
        text_t, text_d = llama_cpp.llama_vocab_get_text(vt, token_id), llama_cpp.llama_vocab_get_text(vd, token_id)
        if text_t != text_d:
            problems.append(f"token {token_id} is {text_d!r} in the drafter and {text_t!r} in the target")
            break
    return problems


LLAMA_CPP_FILE_TYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
                        "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantize_gguf(source: str | Path, destination: str | Path, file_type: str = "q8_0") -> Path:
    """Quantize a GGUF file with llama.cpp's own quantizer (``llama-quantize``'s ``llama_model_quantize``).

    On a CPU a drafter costs what its weights weigh: an f32 file of a 2-layer SmolLM2 truncation (its 49k x 576
    head is most of it) is 135 MB, more than the 94 MB Q4_1 target. ``q8_0`` keeps its logits close. Tensors whose
    width a type cannot block fall back as in ``llama-quantize`` (llama.cpp's ``tensor_type_fallback``).
    """
    llama_cpp = require_llama_cpp()
    if file_type not in LLAMA_CPP_FILE_TYPES:
        raise ValueError(f"file_type must be one of {sorted(LLAMA_CPP_FILE_TYPES)}, got {file_type!r}.")
    source, destination = Path(source), Path(destination)
    if not source.is_file():
        raise FileNotFoundError(f"{source} is not a GGUF file: export one with ppow_trl.export_gguf first.")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_CPP_FILE_TYPES[file_type])
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(destination).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {file_type} (status {status}).")
    return destination


def read_window_policy(gguf_path: str | Path) -> AdaptiveWindowPolicy | None:
    """The ``ppow_window_policy.json`` saved next to a GGUF drafter (the standalone family's export folder), or None."""
    file = Path(gguf_path).parent / WINDOW_POLICY_FILE
    return AdaptiveWindowPolicy.from_pretrained(file.parent) if file.is_file() else None


def common_prefix_length(a, b) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if differs.size else n


try:  # the hook's base class when llama-cpp-python is installed; a plain object otherwise (the error comes at use)
    from llama_cpp.llama_speculative import LlamaDraftModel as _DraftBase
except ImportError:  # pragma: no cover - depends on the optional install
    _DraftBase = object


class LlamaCppDrafter(_DraftBase):
    """A GGUF drafter as llama-cpp-python's draft model, drafting greedily with the project's window rule.

    ``Llama(target.gguf, draft_model=LlamaCppDrafter("drafter.gguf"))``: at the start of every round llama-cpp-python
    passes the committed ids (prompt and every token kept so far); the drafter brings its KV cache up to them (it
    keeps the longest common prefix with what it has evaluated: one batched forward of the new ids, at least one),
    then proposes ``y_i = argmax z_i`` while ``prod_{j<=i} conf_j >= h`` and ``i < K`` (the first token is
    always proposed; ``conf = max softmax(z / T_c)``, the same functions as every other route). The online guard,
    when the policy has one, pauses drafting where it does not pay (a paused round returns no tokens: the target
    decodes one token plainly).

    Args:
        model_path: the drafter's ``.gguf`` file (``export_gguf``).
        policy: the window rule; default: the ``ppow_window_policy.json`` saved next to the file (the recipe writes
            it with ``--export_format gguf``), else a fixed window of ``max_window`` tokens (4 if not given, with a
            warning). The rule is applied as given; its calibration (``K``, ``h``, the guard's break-even) was
            measured for the route it was calibrated on, and llama.cpp's costs differ: pass ``max_window=`` /
            ``threshold=`` for llama.cpp's own.
        max_window / threshold: override ``K`` / ``h`` of the policy.
        target: the target ``Llama``; when given, the pair is checked as llama.cpp's programs check it
            (``pairing_problems``) and refused with the reasons.
        n_ctx / n_threads / kv_cache_type: of the drafter's llama.cpp context (``load_llama``); ``n_ctx`` defaults to
            the target's when it is given, else 2048. A window never runs past the drafter's context.

    ``rounds`` holds ``(L, A)`` per drafting round (window length, accepted length; ``A`` is learnt at the next
    call, from the committed ids), for tau and acceptance figures; ``reset_stats()`` clears it. A call whose ids do
    not extend the last call's starts a new generation: the guard starts it (``SpeculationGuard.new_generation``:
    afresh, or carrying its evidence over with ``across_generations``) and the last window is not scored.

    The exported file keeps the drafter's whole head. A reduced head written with ``expand_reduced_head=True`` gives
    logit 0 to ids outside its draft vocabulary; those zeros enter ``conf`` here (they were ``-inf`` in training).
    """

    def __init__(self, model_path, policy: AdaptiveWindowPolicy | None = None, *, max_window: int | None = None,
                 threshold: float | None = None, target=None, n_ctx: int | None = None, n_threads: int | None = None,
                 kv_cache_type: str = "f16"):
        n_ctx = n_ctx or (target.n_ctx() if target is not None else 2048)
        self.llama = load_llama(model_path, n_ctx=n_ctx, n_threads=n_threads, kv_cache_type=kv_cache_type)
        if target is not None:
            problems = pairing_problems(target, self.llama)
            if problems:
                raise ValueError(f"llama.cpp would refuse {model_path} as the draft model of this target: "
                                 + "; ".join(problems))
        policy = policy or read_window_policy(model_path)
        if policy is None:
            if max_window is None:
                logger.warning("No %s next to %s and no max_window: drafting a fixed window of 4 tokens.",
                               WINDOW_POLICY_FILE, model_path)
            policy = AdaptiveWindowPolicy(max_window=4 if max_window is None else max_window)
        if max_window is not None or threshold is not None:
            policy = policy.with_window(policy.max_window if max_window is None else max_window,
                                        policy.threshold if threshold is None else threshold)
        self.policy = policy
        self.guard = policy.new_guard(fresh=True)  # its own, carried over by new_generation
        self._logits_ith = require_llama_cpp().llama_get_logits_ith  # read once per drafted token
        self.n_vocab = self.llama.n_vocab()
        self.rounds: list[tuple[int, int]] = []
        self._pending = None  # (committed length, drafted ids) of the last window, scored at the next call
        self._committed = None  # the ids of the last call: a call that does not extend them is a new generation

    def reset_stats(self) -> None:
        """Forget the recorded rounds and start a new generation (the guard's evidence carries over with
        ``across_generations``)."""
        self.rounds = []
        self._new_generation()

    def _new_generation(self) -> None:
        self._pending = self._committed = None
        if self.guard is not None:
            self.guard.new_generation()

    def __call__(self, input_ids, /, **kwargs) -> np.ndarray:
        committed = np.array(input_ids, dtype=np.intc)  # a copy: llama-cpp-python passes a view of its buffer
        previous = self._committed
        if previous is not None and (len(committed) <= len(previous)
                                     or common_prefix_length(previous, committed) < len(previous)):
            self._new_generation()  # another prompt (or a restarted one): nothing carries over
        self._committed = committed
        self._score_previous_window(committed)
        room = self.llama.n_ctx() - len(committed)  # the window's tokens but the last are evaluated by the drafter
        if self.policy.max_window == 0 or room < 1 or (self.guard is not None and not self.guard.decide()):
            return np.array([], dtype=np.intc)
        if self.guard is not None:
            self.guard.drafting_call(committed.tolist())
        window = self._draft(committed, max_window=min(self.policy.max_window, room))
        self._pending = (len(committed), window)
        if self.guard is not None:
            self.guard.drafted(len(committed), window)
        return np.array(window, dtype=np.intc)

    def _score_previous_window(self, committed: np.ndarray) -> None:
        """Record ``(L, A)`` of the last window: ``A`` = its leading matches with what was committed after it."""
        if self._pending is None:
            return
        start, window = self._pending
        self.rounds.append((len(window), common_prefix_length(window, committed[start:])))
        self._pending = None

    def _draft(self, committed: np.ndarray, max_window: int) -> list[int]:
        """Greedy tokens after ``committed`` under the window rule, at most ``max_window``."""
        llama = self.llama
        keep = min(common_prefix_length(llama.input_ids[: llama.n_tokens], committed), len(committed) - 1)
        llama.n_tokens = keep  # Llama.eval removes the KV entries from n_tokens on
        llama.eval(committed[keep:].tolist())
        window, running = [], 1.0
        while True:
            logits = torch.from_numpy(self._last_logits())
            window.append(int(logits.argmax()))
            running *= float(window_confidence(logits, self.policy.confidence_temperature))
            if not keep_drafting(running, len(window), max_window, self.policy.threshold):
                return window
            llama.eval([window[-1]])

    def _last_logits(self) -> np.ndarray:
        """The drafter's logits after the last evaluated token (a copy)."""
        pointer = self._logits_ith(self.llama.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()


def mean_accepted_length(rounds) -> float:
    """tau of recorded ``(L, A)`` rounds: ``mean(A + 1)``, the tokens each drafting round commits (NaN without any)."""
    return float(np.mean([accepted + 1 for _, accepted in rounds])) if rounds else float("nan")
