"""The drafter interface every loop uses, and the registry of drafter families: the protocol, nothing else.

A **drafter family** (``DrafterFamily``) is one kind of drafter: how to recognise it (a model in memory, a folder
or a Hub id), build it from a target, load and save it in every layout it knows, draft with it (its
``DraftingSession``), train it (the PEFT task type, the differentiable ``window_hidden`` the PPOW loss uses, the
KD rows and the context scoring), what its cost model charges (per drafted token or per round) and how it joins
``target.generate(assistant_model=...)``. Callers ask ``family_of(drafter)`` or ``get_family(name)`` and never
branch on a family's name: a new family is one module plus one line in ``FAMILIES``.

Families (``FAMILIES``, in ``ppow_trl.drafters``): ``standalone`` (any causal LM over the target's vocabulary,
``ppow_trl.drafters.standalone``), ``eagle3`` (heads reading the target's hidden states, ``ppow_trl.drafters.eagle3``),
``dflash`` (block drafters, ``ppow_trl.drafters.dflash``), ``prompt_lookup`` (n-gram drafting from the text itself,
``ppow_trl.drafters.prompt_lookup``), ``hybrid`` (prompt lookup where the text repeats, a trained drafter elsewhere,
``ppow_trl.drafters.hybrid``: the one family built from others, a layer above them).
The registry names each by ``"module:Class"`` and imports it on first use, like a package entry point, so this
bottom-layer module imports no family and no family imports another (the import-linter contracts in
``setup.cfg`` check both).

A **drafting session** holds one drafter's state over committed sequences and answers the same calls whatever
the family:

- ``prefill(contexts, pad_id, num_samples, features)``: the drafter's next-token logits after a batch of contexts
  (left-padded, shared by ``G`` samples each), for rollouts;
- ``extend(sequence, features)``: catch up on the committed tokens it has not seen (one sequence), for generation;
  ``add_features(features)``: the target features of newly committed positions;
- ``step(tokens)``: append one drafted token per row, giving the logits of the next one;
- ``rollback(valid_length)``: forget what lies beyond the verified prefix after a round;
- ``teacher_forced_logits(prompt, text, max_window, features)``: the proposals of a window started after every
  prefix of a known text (exact greedy tau, without running the loop);
- ``timed_step(context, features)``: a callable running one unit the cost model charges (a drafted token, or a
  round for a block drafter), state put back after each call (``ppow_trl.core.cost``);
- ``forwards``: drafter forwards run so far; ``target_layer_ids``: the target features it reads (``None``: none);
  ``max_window``: the most tokens it drafts per round (``None``: no limit).

tau everywhere is tokens generated per target forward pass, including the bonus token (EAGLE's convention).
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import torch

from .utils import unwrap_model

FAMILIES: dict[str, str] = {
    "eagle3": "ppow_trl.drafters.eagle3.family:Eagle3Family",
    "dflash": "ppow_trl.drafters.dflash.family:DFlashFamily",
    "prompt_lookup": "ppow_trl.drafters.prompt_lookup:PromptLookupFamily",
    "hybrid": "ppow_trl.drafters.hybrid:HybridFamily",  # prompt lookup + a trained drafter (composes two families)
    "standalone": "ppow_trl.drafters.standalone:StandaloneFamily",  # last: any causal LM, the fallback of family_of
}
"""Registered families, ``name -> "module:Class"``, in the order ``family_of`` asks them (``register_family``)."""

_LOADED: dict[str, "DrafterFamily"] = {}


@runtime_checkable
class DraftingSession(Protocol):
    """One drafter's state over committed sequences (module docstring)."""

    forwards: int
    target_layer_ids: list[int] | None
    max_window: int | None

    def prefill(self, contexts: list[torch.Tensor], pad_id: int = 0, num_samples: int = 1,
                features: list[torch.Tensor] | None = None) -> torch.Tensor: ...

    def extend(self, sequence: list[int], features: torch.Tensor | None = None) -> torch.Tensor | None: ...

    def add_features(self, features: torch.Tensor | None) -> None: ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor: ...

    def rollback(self, valid_length: int) -> None: ...

    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int,
                              features: torch.Tensor | None = None): ...

    def timed_step(self, context: list[int], features: torch.Tensor | None): ...


class DrafterFamily:
    """One kind of drafter (module docstring). Subclasses set the attributes and implement the methods they need;
    the defaults describe a trainable per-token drafter that reads no target features.

    Attributes:
        name: the registry name (``FAMILIES``), also the recipe's ``drafter_type`` and the study's family column.
        description: a few words for logs and tables.
        peft_task_type: PEFT's ``task_type`` for a LoRA on this drafter (``None``: PEFT's plain wrapper).
        cost_per_round: the cost model charges ``t_d`` once per round (one forward drafts the window), not per token.
        trainable: KD and PPOW can train it (a family without parameters is only evaluated).
        hf_methods: which of the benchmark's HF-native assistant schedules can run it (``None``: all of them; it
            is a causal LM HF can call), the others run it through ``ppow_trl``'s loop and hook.
        export_formats: the layouts ``export`` writes besides ``save_pretrained``.
        reads_target: the drafter drafts from the target's hidden states or modules: sessions, serving and the
            cost model need ``target``.
        runs_on_target: the drafter computes with the target's own modules (embedding, head), so it cannot draft,
            train or be scored without ``target``.
        reduced_head: the drafter can have a reduced-vocabulary head (``draft_vocab_ids`` of ``build``).
        hf_generate_kwargs: extra ``target.generate`` arguments of the family's own route in transformers (DFlash:
            ``speculation_type="dflash"``); empty for drafters HF calls as assistant causal LMs.
        compiles: the drafter is a causal LM over its own KV cache, which the compiled runtime
            (``ppow_trl.serving.runtime``) compiles like the target; the others draft eagerly.
        writes_hook_file: ``save_assistant`` copies ``custom_generate/generate.py`` into its folders (HF calls the
            drafter's ``generate`` as an assistant); a family with its own native route does not.
    """

    name: str = ""
    description: str = ""
    peft_task_type: str | None = "CAUSAL_LM"
    cost_per_round: bool = False
    trainable: bool = True
    hf_methods: tuple[str, ...] | None = None
    export_formats: tuple[str, ...] = ()
    writes_hook_file: bool = True
    reduced_head: bool = True
    hf_generate_kwargs: dict = {}
    reads_target: bool = False
    runs_on_target: bool = False
    compiles: bool = False

    # -- recognising -------------------------------------------------------------------------------------
    def owns(self, model) -> bool:
        """Whether ``model`` (unwrapped) is a drafter of this family."""
        raise NotImplementedError

    def detect(self, folder_or_repo, **hub_kwargs) -> str | None:
        """The layout of this family's drafter in a folder or Hub repo (e.g. ``"transformers"``), else ``None``."""
        return None

    # -- building, loading, saving ------------------------------------------------------------------------
    def build(self, target, tokenizer=None, *, draft_vocab_ids=None, seed: int | None = 0,
              target_name_or_path: str | None = None, **options):
        """A new drafter for ``target`` (``options``: the family's own, e.g. ``num_layers``)."""
        raise NotImplementedError(f"The {self.name} family builds no drafter from a target.")

    def load(self, folder_or_repo, *, target=None, **from_pretrained_kwargs):
        """The drafter saved in a folder or Hub repo, in any layout ``detect`` recognises, ready to train (its
        trainable parameters require grad, as after ``build``)."""
        raise NotImplementedError

    def export(self, drafter, folder, *, format: str, target=None):
        """Write ``drafter`` in another engine's layout (``export_formats``)."""
        raise ValueError(f"The {self.name} family exports no other layout (export_format must be unset).")

    def check_export_format(self, format: str | None) -> None:
        """Refuse an export layout this family does not write, before any work starts."""
        if format is not None and format not in self.export_formats:
            raise ValueError(f"export_format {format!r} does not apply to {self.name} drafters (allowed: "
                             f"{list(self.export_formats) or 'none'}).")

    # -- drafting -----------------------------------------------------------------------------------------
    def session(self, drafter, target=None) -> DraftingSession:
        """A new drafting session (``target``: the model whose features or head the drafter reads)."""
        raise NotImplementedError

    def target_layer_ids(self, drafter) -> list[int] | None:
        """The target ``output_hidden_states`` indices the drafter reads; ``None`` when it reads none."""
        return None

    def planned_layer_ids(self, target, **build_options) -> list[int] | None:
        """The indices a drafter ``build(target, **build_options)`` would read, known before it is built (so that the
        data's labelling forward can keep those states); ``None`` when it reads none or cannot say."""
        return None

    def check_target(self, drafter, target) -> None:
        """Refuse a target other than the one the drafter reads, saying what differs."""

    def input_vocab_size(self, drafter, target) -> int:
        """How many token ids the drafter can read (what ``check_compatibility`` and the cost model's random
        contexts need)."""
        return drafter.get_input_embeddings().num_embeddings

    def describe(self, drafter) -> str:
        """One line for logs and model cards."""
        return f"{type(unwrap_model(drafter)).__name__} ({self.description})"

    # -- training -----------------------------------------------------------------------------------------
    def prepare_for_training(self, drafter, target=None) -> None:
        """Called by the trainers once before training (e.g. a generation config TRL writes to)."""

    def window_hidden(self, drafter, contexts: list[torch.Tensor], inverse: torch.Tensor, window_ids: torch.Tensor,
                      *, target=None, features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The states whose projection by ``output_head`` gives ``log q(y_i | c, y_<i)``, with gradients:
        ``(B, C, H)`` for windows ``window_ids`` ``(B, C)`` drafted after ``contexts[inverse[b]]`` (each distinct
        context computed once). The PPOW loss (``ppow_trl.training.window_logprobs``) calls it."""
        raise NotImplementedError(f"The {self.name} family has no trainable loss path.")

    def output_head(self, drafter, target=None) -> torch.nn.Module:
        """The head applied to ``window_hidden``'s states (the drafter's own, or the target's)."""
        return drafter.get_output_embeddings()

    def kd_rows(self, model, inputs: dict, mask: torch.Tensor, args, target=None):
        """KD's student rows: ``([(logits (N, C), teacher_mask (B, T))], model output)``, one pair per slot
        (``ppow_trl.training.kd_trainer``)."""
        raise NotImplementedError(f"The {self.name} family has no KD objective.")

    def kd_slot_weights(self, args, num_slots: int) -> list[float] | None:
        """Per-slot loss weights of ``kd_rows`` (``None``: one slot, token-weighted like a causal LM)."""
        return None

    def response_distributions(self, model, ids, mask, positions, keep: int, *, target=None, features=None,
                               feature_layers=None):
        """Logits at the last ``keep`` columns of a left-padded batch (column ``j``: the first token of a window
        drafted after ``ids[:j + 1]``) and the hidden states at ``feature_layers`` when asked (context scoring,
        ``ppow_trl.training.contexts``). Returns ``(logits (B, keep, V), features or None)``."""
        raise NotImplementedError

    # -- serving ------------------------------------------------------------------------------------------
    def fit_confidences(self, drafter, contexts) -> dict:
        """Fit, in place, what this drafter's confidences mean on held-out ``contexts`` (token id sequences), before
        the window rule is calibrated on them (``calibrate_for_serving``); returns the fitted settings (``{}``: a
        trained drafter's softmax is its own confidence, nothing to fit). Prompt lookup fits the hit rate of each
        n-gram length."""
        return {}

    def variants(self, drafter, rollouts: dict) -> list[tuple[dict, dict]]:
        """Other ways this drafter can propose, as ``(settings, rollouts)``: the settings (``use_variant``) and the
        calibration rollouts ``{regime: (confidences, prefix_acceptance, charged)}`` the drafter would have had,
        derived from ``rollouts`` (its own). The serving calibration serves a variant when it is predicted faster.
        ``[]``: one way only (the hybrid offers its lookups without its trained drafter)."""
        return []

    def use_variant(self, drafter, settings: dict) -> dict:
        """Apply a variant's ``settings`` to ``drafter`` in place; returns what the calibration reports of it."""
        raise NotImplementedError(f"The {self.name} family offers no variants.")

    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        """Make ``target.generate(..., assistant_model=drafter)`` apply ``policy``; returns the drafter."""
        raise NotImplementedError

    def with_compiled_models(self, drafter, compile):
        """The drafter as the compiled runtime serves it: ``compile(model)`` (a ``CompiledCausalLM`` of it) where
        the family ``compiles``, the drafter as it is otherwise (a composite family compiles its parts)."""
        return compile(drafter) if self.compiles else drafter

    def detach(self, drafter) -> None:
        """Undo ``attach``'s hooks on the target (a no-op where none were installed)."""


def register_family(name: str, family: str | DrafterFamily) -> None:
    """Add (or replace) a family: ``family`` is an instance or ``"module:Class"`` (imported on first use). It is
    asked first by ``family_of`` and ``detect_family``, so the standalone fallback (any causal LM) stays last."""
    _LOADED.pop(name, None)
    if isinstance(family, DrafterFamily):
        _LOADED[name] = family
        family = f"{type(family).__module__}:{type(family).__name__}"
    entries = {key: value for key, value in FAMILIES.items() if key != name}
    FAMILIES.clear()
    FAMILIES.update({name: family, **entries})


def family_names() -> list[str]:
    """The registered family names."""
    return list(FAMILIES)


def get_family(name: str) -> DrafterFamily:
    """The family registered as ``name``."""
    if name not in FAMILIES:
        raise ValueError(f"Unknown drafter family {name!r}: registered are {family_names()} "
                         "(ppow_trl.drafting.register_family adds one).")
    if name not in _LOADED:
        module, _, cls = FAMILIES[name].partition(":")
        family = getattr(importlib.import_module(module), cls)()
        family.name = family.name or name
        _LOADED[name] = family
    return _LOADED[name]


def family_of(drafter: Any) -> DrafterFamily:
    """The family of a drafter in memory (PEFT / DDP wrappers looked through)."""
    model = unwrap_model(drafter)
    for name in FAMILIES:
        family = get_family(name)
        if family.owns(model):
            return family
    raise ValueError(f"{type(model).__name__} belongs to no registered drafter family ({family_names()}).")


def detect_family(folder_or_repo, **hub_kwargs) -> tuple[DrafterFamily, str]:
    """``(family, layout)`` of the drafter in a local folder or Hub repo id (each family's ``detect``)."""
    for name in FAMILIES:
        family = get_family(name)
        layout = family.detect(folder_or_repo, **hub_kwargs)
        if layout:
            return family, layout
    raise ValueError(f"{folder_or_repo} holds no drafter any registered family recognises ({family_names()}).")


def load_drafter(folder_or_repo, *, target=None, **from_pretrained_kwargs):
    """The drafter in a folder or Hub repo, loaded by its family in whichever layout it was saved; on ``target``'s
    device when one is given (and no ``device_map``), where the loops run it."""
    family, _ = detect_family(folder_or_repo, **{k: v for k, v in from_pretrained_kwargs.items()
                                                 if k in HUB_KWARGS})
    drafter = family.load(folder_or_repo, target=target, **from_pretrained_kwargs)
    if target is not None and "device_map" not in from_pretrained_kwargs:
        drafter = drafter.to(next(target.parameters()).device)
    return drafter


HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")
"""Keyword arguments of a load that also locate single files of a Hub repo (``hf_hub_download``)."""


def drafting_session(drafter, target=None) -> DraftingSession:
    """The session of ``drafter``'s family (``target``: the model whose features or head it reads)."""
    return family_of(drafter).session(drafter, target)


def target_layer_ids(drafter) -> list[int] | None:
    """The target ``output_hidden_states`` indices ``drafter`` reads; ``None`` when it reads none."""
    return family_of(drafter).target_layer_ids(unwrap_model(drafter))


def check_window(session: DraftingSession, max_window: int) -> None:
    """Refuse a window longer than the drafter can propose per round (a block drafter's ``block_size - 1``)."""
    if session.max_window is not None and max_window > session.max_window:
        raise ValueError(f"max_window (K) = {max_window}, but this drafter proposes at most {session.max_window} "
                         f"tokens per round (a block drafter: block_size - 1): use K <= {session.max_window}, or a "
                         "drafter that drafts more (a larger block_size).")
