"""The hybrid drafter family: prompt lookup where the text repeats, a trained drafter everywhere else.

Prompt lookup drafts for free but only where the sequence's last n-gram occurred before; a trained drafter drafts
everywhere at a cost. The hybrid proposes, token by token, the lookup's token when ``lookup_next_match`` finds one
that is worth it and the trained drafter's otherwise. Its next-token distribution is a function of the sequence like
any drafter's:

    ``q(. | x) = q_lookup(. | x)`` if the last ``n`` tokens of ``x`` recur (``n = max_ngram_size .. min_ngram_size``)
    and ``p_n >= min_match_confidence``, ``q_model(. | x)`` otherwise,

where ``p_n`` is the fitted hit rate of an ``n``-gram match (``ppow_trl.drafters.prompt_lookup``; fitted by
``calibrate_for_serving`` on its held-out contexts) and ``min_match_confidence`` is 1/2: a lookup proposes where it is
right more often than not. Before the fit every match counts: a unigram match (right 16-20% of the time on SmolLM2's
responses) then displaces the trained drafter's proposal after every common token.

so the window rule (``prod conf_j >= h``, up to ``K``; a looked-up token's confidence is about 1), the calibration of
``(K, h)``, the online guard, and greedy and sampled verification apply unchanged, and decoding stays lossless.

The trained drafter is read lazily: while lookups supply the tokens it does not run, and when it is needed it
catches up on every token it has not read in one forward (``StandaloneSession.extend``). The cost model's ``t_d`` is
the trained drafter's step (``timed_step``); the calibration charges it only for the tokens the model proposed
(``DraftedWindows.charged``, from the session's ``charged_steps``), so a round of looked-up tokens costs its
verification and the loop's host work, as prompt lookup's does.

Nothing new is trained: train the inner drafter (``PPOWTrainer``, KD), then wrap it (``hybrid_drafter``). The inner
drafter is any family that reads no target features (standalone drafters, the main job's reduced-vocabulary one).
On disk, ``save_pretrained`` writes the hybrid's ``config.json`` and the inner drafter in ``drafter/``, in its own
family's layout; ``load_drafter`` and ``load_assistant`` read it back.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, PretrainedConfig, PreTrainedModel

from ._family_io import local_folder, read_config
from ..serving.assistant_loop import check_assistant_call, draft_window
from ..drafting import HUB_KWARGS, DrafterFamily, family_of, get_family, load_drafter
from .prompt_lookup import (PromptLookupDrafter, PromptLookupSession, check_lookup_settings, describe_fit,
                            fit_lookup_config)
from ..models import logits_width
from ..utils import is_peft_model, unwrap_model
from ..core.windowing import configure_generation_config

INNER_FOLDER = "drafter"
"""The subfolder of a saved hybrid holding its trained drafter."""


class HybridConfig(PretrainedConfig):
    """The lookup's settings (``PromptLookupConfig``'s: vocabulary, n-gram sizes, ``confidence_logit > 0``), the
    inner drafter's family name (informational; its folder says it too), and ``model_proposes``: whether the trained
    drafter proposes where the lookup finds nothing (``False``: the hybrid drafts looked-up tokens only, set by
    ``HybridFamily.use_variant`` when the calibration predicts that the trained drafter's windows lose)."""

    model_type = "ppow_hybrid"

    def __init__(self, vocab_size: int = 32000, max_ngram_size: int = 3, min_ngram_size: int = 1,
                 confidence_logit: float = 20.0, drafter_family: str = "standalone",
                 match_confidences: list[float] | None = None, min_match_confidence: float = 0.5,
                 model_proposes: bool = True, **kwargs):
        if confidence_logit <= 0:
            raise ValueError(f"confidence_logit must be > 0 (a looked-up token must beat the rest), got "
                             f"{confidence_logit}.")
        check_lookup_settings(max_ngram_size, min_ngram_size, match_confidences, min_match_confidence)
        self.vocab_size, self.max_ngram_size, self.min_ngram_size = vocab_size, max_ngram_size, min_ngram_size
        self.confidence_logit, self.drafter_family = confidence_logit, drafter_family
        self.match_confidences = None if match_confidences is None else [float(p) for p in match_confidences]
        self.min_match_confidence = float(min_match_confidence)
        # False: lookups only, the trained drafter proposes nothing (calibration chose it: its windows lost)
        self.model_proposes = bool(model_proposes)
        super().__init__(**kwargs)


class HybridDrafter(PreTrainedModel, GenerationMixin):
    """A prompt-lookup drafter and a trained drafter (``.drafter``) drafting as one (module docstring)."""

    config_class = HybridConfig
    base_model_prefix = "hybrid"
    main_input_name = "input_ids"

    def __init__(self, config: HybridConfig, drafter=None):
        super().__init__(config)
        # the hybrid's own config: the lookup reads its n-gram settings and fitted confidences, and every copy made by
        # with_drafter (the compiled runtime's) shares them, so a fit on one is seen by all
        self.lookup = PromptLookupDrafter(config)
        self.post_init()
        # Attached after post_init: transformers' weight initialisation must never touch the trained drafter.
        self.drafter = drafter

    def _init_weights(self, module):
        """Nothing to initialise (the trained drafter comes initialised)."""

    def forward(self, *args, **kwargs):
        raise TypeError("A hybrid drafter drafts through its session (ppow_trl.drafting.drafting_session) or as an "
                        "assistant (target.generate(..., assistant_model=drafter) after load_assistant).")

    def with_drafter(self, drafter) -> "HybridDrafter":
        """The same lookup over another inner drafter (the compiled runtime's copy of it)."""
        hybrid = HybridDrafter(self.config, drafter)
        hybrid.generation_config = self.generation_config
        return hybrid.to(self.lookup.anchor.device)

    def save_pretrained(self, save_directory, **kwargs):
        """``config.json`` and ``generation_config.json`` here, the inner drafter in ``drafter/`` (its own layout)."""
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        self.config.save_pretrained(folder)
        self.generation_config.save_pretrained(folder)
        unwrap_model(self.drafter).save_pretrained(folder / INNER_FOLDER, **kwargs)


def _check_inner(drafter) -> None:
    family = family_of(drafter)
    if family.reads_target or family.cost_per_round or family.name in ("prompt_lookup", "hybrid"):
        raise ValueError(f"A hybrid drafter wraps a drafter that drafts token by token from the text alone (a "
                         f"standalone causal LM); a {family.name} drafter does not. Serve it on its own, or prompt "
                         "lookup on its own.")


def hybrid_drafter(drafter, target=None, *, max_ngram_size: int = 3, min_ngram_size: int = 1,
                   confidence_logit: float = 20.0) -> HybridDrafter:
    """Wrap a trained ``drafter`` (merged: not a PEFT model) with prompt lookup (module docstring). The lookup's
    logits have the inner drafter's width, so that every token the hybrid proposes has one shape whichever part
    proposed it."""
    if is_peft_model(drafter):
        raise ValueError("hybrid_drafter wraps the drafter as served: merge the adapter first "
                         "(`drafter = peft_model.merge_and_unload()`).")
    _check_inner(drafter)
    vocab_size = logits_width(drafter)
    config = HybridConfig(vocab_size=vocab_size, max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size,
                          confidence_logit=confidence_logit, drafter_family=family_of(drafter).name)
    hybrid = HybridDrafter(config, drafter)
    source = target if target is not None else unwrap_model(drafter)
    if getattr(source, "generation_config", None) is not None:
        hybrid.generation_config = GenerationConfig.from_dict(source.generation_config.to_dict())
    return hybrid.to(next(drafter.parameters()).device).eval()


def _choose(lookup_logits: torch.Tensor, model_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row by row, the lookup's logits where it found a token (its row's maximum is ``confidence_logit > 0``; a row
    without a match is all zeros), the model's elsewhere; both over the model's width. Returns ``(logits, matched)``
    with ``matched`` ``(...,)`` True where the lookup proposed."""
    width = model_logits.shape[-1]
    lookup_logits = lookup_logits[..., :width].to(model_logits.dtype)
    if lookup_logits.shape[-1] < width:
        lookup_logits = torch.nn.functional.pad(lookup_logits, (0, width - lookup_logits.shape[-1]))
    matched = lookup_logits.amax(dim=-1, keepdim=True) > 0
    return torch.where(matched, lookup_logits.to(model_logits.device), model_logits), matched.squeeze(-1)


class HybridSession:
    """Drafting state: the lookup's sequences and the inner drafter's session (read lazily for one sequence)."""

    target_layer_ids = None

    def __init__(self, drafter: HybridDrafter, target=None):
        self.drafter = drafter
        self.lookup = PromptLookupSession(drafter.lookup)
        self.model = family_of(drafter.drafter).session(drafter.drafter, target)
        self.max_window = self.model.max_window
        self.looked_up = 0  # tokens proposed by the lookup (one sequence), for reports
        self.forwards = 0  # proposals made (one per drafted token): what the cost model charges
        # batches: per proposal step, (B,) 1 where the model proposed (charged t_d), 0 where the lookup did
        # (``DraftedWindows.charged``: the calibration charges the drafter's step only where it ran)
        self.charged_steps: list[torch.Tensor] = []

    @property
    def model_proposes(self) -> bool:
        return self.drafter.config.model_proposes

    @property
    def model_forwards(self) -> int:
        """Forwards the trained drafter ran (``forwards`` counts the lookups' proposals too)."""
        return self.model.forwards

    def _chosen(self, lookup_logits: torch.Tensor, model_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_choose``, with nothing from the model for lookups alone (its state is kept in step, unused)."""
        if not self.model_proposes:
            model_logits = torch.zeros_like(model_logits)
        return _choose(lookup_logits, model_logits)

    def _batch(self, lookup_logits: torch.Tensor, model_logits: torch.Tensor) -> torch.Tensor:
        logits, matched = self._chosen(lookup_logits, model_logits)
        self.charged_steps.append(~matched if self.model_proposes else torch.zeros_like(matched))
        return logits

    # one sequence: the model runs only when the lookup finds nothing ----------------------------------------
    def _next(self) -> torch.Tensor:
        self.forwards += 1
        sequence = self.lookup.sequences[0]
        proposal = self.drafter.lookup.proposal(sequence)
        if proposal is not None:
            self.looked_up += 1
            return self.drafter.lookup.proposal_logits([proposal])
        if not self.model_proposes:  # lookups only: nothing proposed (all-zero logits end the window for any h > 0)
            self.forwards -= 1
            return self.drafter.lookup.proposal_logits([None])
        return self.model.extend(sequence)  # reads every token it has not read yet, in one forward

    def extend(self, sequence: list[int], features=None) -> torch.Tensor:
        self.lookup.sequences = [list(sequence)]
        self.charged_steps = []
        return self._next()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if len(self.lookup.sequences) != 1 or self.charged_steps:  # a batch (rollouts): both step, the rows choose
            return self._batch(self.lookup.step(tokens), self.model.step(tokens))
        self.lookup.sequences[0].append(int(tokens.view(-1)[0]))
        return self._next()

    def add_features(self, features) -> None:
        """The inner drafter reads no target features."""

    def rollback(self, valid_length: int) -> None:
        self.lookup.rollback(valid_length)
        self.model.rollback(valid_length)

    # batches (rollouts, calibration) ---------------------------------------------------------------------------
    def prefill(self, contexts, pad_id: int = 0, num_samples: int = 1, features=None) -> torch.Tensor:
        self.charged_steps = []
        return self._batch(self.lookup.prefill(contexts, pad_id, num_samples),
                           self.model.prefill(contexts, pad_id, num_samples))

    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int, features=None):
        """Slot ``k`` of a window after ``prompt + text[:s]``: the hybrid's choice after ``prompt + text[:s + k]``,
        from both families' teacher-forced passes (both are functions of the sequence)."""
        lookups = self.lookup.teacher_forced_logits(prompt, text, max_window)
        models = self.model.teacher_forced_logits(prompt, text, max_window)
        for (slot, lookup_logits), (_, model_logits) in zip(lookups, models):
            yield slot, self._chosen(lookup_logits, model_logits)[0]

    def timed_step(self, context: list[int], features=None):
        """The inner drafter's step: every drafted token is charged as if the model drafted it (module docstring)."""
        return self.model.timed_step(context, None)


@torch.no_grad()
def hybrid_generate(*args, model, input_ids=None, generation_config=None, logits_processor=None, max_new_tokens=None,
                    **kwargs):
    """The hybrid's ``generate`` as HF's assistant: one window after the committed ``input_ids``. The session is kept
    between calls of one generation (its inner drafter's cache is rolled back, not rebuilt)."""
    input_ids = input_ids if input_ids is not None else args[0]
    check_assistant_call(generation_config, input_ids, "hybrid")
    sequence = input_ids[0].tolist()
    session = getattr(model, "_ppow_session", None)
    if session is None or session.lookup.sequences[0] != sequence[: len(session.lookup.sequences[0])]:
        session = HybridSession(model)  # a new generation (or another sequence): start over
        model._ppow_session = session
    session.rollback(len(sequence) - 1)  # the inner drafter re-reads at least the last token: it gives its logits
    looked_up = session.looked_up
    logits = session.extend(sequence)
    if not model.config.model_proposes and session.looked_up == looked_up:
        # lookups alone, and none matched: transformers' loop needs a candidate, so the trained drafter proposes it
        # (a better guess than an unproposed token, and charged as its step)
        logits = session.model.extend(sequence)
    return draft_window(model, session, logits, input_ids, generation_config, logits_processor, max_new_tokens,
                        looked_up_before=looked_up)


class HybridFamily(DrafterFamily):
    """Prompt lookup + a trained drafter (module docstring)."""

    name = "hybrid"
    description = "prompt lookup where the text repeats, a trained drafter elsewhere"
    peft_task_type = None
    trainable = False  # train the inner drafter, then wrap it
    reduced_head = False
    writes_hook_file = False  # its HF route is its own generate, installed by attach
    hf_methods = ()

    def owns(self, model) -> bool:
        return isinstance(model, HybridDrafter)

    def detect(self, folder_or_repo, **hub_kwargs) -> str | None:
        config = read_config(folder_or_repo, **hub_kwargs)
        return "transformers" if config and config.get("model_type") == HybridConfig.model_type else None

    def build(self, target, tokenizer=None, *, draft_vocab_ids=None, seed: int | None = 0, target_name_or_path=None,
              drafter=None, max_ngram_size: int = 3, min_ngram_size: int = 1, confidence_logit: float = 20.0,
              **options):
        """A hybrid over ``drafter``, or over a new standalone drafter built with the remaining ``options``."""
        if drafter is None:
            drafter = get_family("standalone").build(target, tokenizer, draft_vocab_ids=draft_vocab_ids, seed=seed,
                                                     target_name_or_path=target_name_or_path, **options)
        elif options:
            raise ValueError(f"{sorted(options)} build a new inner drafter; they do not apply with drafter=.")
        return hybrid_drafter(drafter.eval(), target, max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size,
                              confidence_logit=confidence_logit)

    def load(self, folder_or_repo, *, target=None, **from_pretrained_kwargs):
        """The hybrid's settings from ``config.json``, its inner drafter from ``drafter/`` (a Hub repo is fetched
        first; ``from_pretrained_kwargs`` go to the inner drafter's load, ``trust_remote_code`` included)."""
        hub_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in HUB_KWARGS}
        folder = local_folder(folder_or_repo, **hub_kwargs)
        config = HybridConfig.from_dict(read_config(folder) or {})
        inner = load_drafter(folder / INNER_FOLDER, target=target, **from_pretrained_kwargs)
        hybrid = HybridDrafter(config, inner.eval())
        if (folder / "generation_config.json").is_file():
            hybrid.generation_config = GenerationConfig.from_pretrained(str(folder))
        return hybrid.to(next(inner.parameters()).device).eval()

    def session(self, drafter, target=None):
        return HybridSession(unwrap_model(drafter), target)

    def input_vocab_size(self, drafter, target) -> int:
        inner = drafter.drafter
        return min(drafter.config.vocab_size, family_of(inner).input_vocab_size(inner, target))

    def check_target(self, drafter, target) -> None:
        family_of(drafter.drafter).check_target(drafter.drafter, target)

    def describe(self, drafter) -> str:
        config = drafter.config
        fitted = (f", where its hit rate >= {config.min_match_confidence:g}{describe_fit(config)}"
                  if config.match_confidences is not None else "")
        if not config.model_proposes:
            return (f"hybrid: prompt lookup alone (n-grams {config.max_ngram_size}..{config.min_ngram_size}{fitted}); "
                    f"its {family_of(drafter.drafter).describe(drafter.drafter)} proposes nothing")
        return (f"hybrid: prompt lookup (n-grams {config.max_ngram_size}..{config.min_ngram_size}{fitted}), else "
                f"{family_of(drafter.drafter).describe(drafter.drafter)}")

    def fit_confidences(self, drafter, contexts) -> dict:
        """The lookup's hit rates, and the hybrid as built (``model_proposes=True``): every calibration compares
        it with its lookups alone (``variants``), whatever an earlier calibration of a copy chose."""
        drafter.config.model_proposes = True
        return {**fit_lookup_config(drafter.config, contexts), "model_proposes": True}

    def variants(self, drafter, rollouts: dict) -> list[tuple[dict, dict]]:
        """Lookups alone (``model_proposes=False``): the hybrid's rollouts up to the first token its trained drafter
        proposed, which the lookups alone do not propose (confidence and acceptance 0 from there on: the window
        ends there for any ``h > 0``) and no drafter forward. Exact for every rule with ``h > 0``, as the lookups'
        proposals do not depend on the trained drafter; at ``h = 0`` the windows go on with unproposed tokens that
        are counted as rejected."""
        if not drafter.config.model_proposes or any(charged is None for *_, charged in rollouts.values()):
            return []
        lookups = {}
        for regime, (confidences, prefix, charged) in rollouts.items():
            model = charged.bool().cumsum(dim=1) > 0  # from the first token the trained drafter proposed
            lookups[regime] = (confidences.masked_fill(model, 0.0), prefix.masked_fill(model, 0.0),
                               torch.zeros_like(charged))
        return [({"model_proposes": False}, lookups)]

    def use_variant(self, drafter, settings: dict) -> dict:
        drafter.config.model_proposes = bool(settings["model_proposes"])  # copies (with_drafter) share the config
        return {"model_proposes": drafter.config.model_proposes}

    def with_compiled_models(self, drafter, compile):
        inner = drafter.drafter
        compiled = family_of(inner).with_compiled_models(inner, compile)
        return drafter if compiled is inner else drafter.with_drafter(compiled)

    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        configure_generation_config(drafter.generation_config, policy, vocab_size)
        drafter._ppow_session = None
        drafter.generate = functools.partial(hybrid_generate, model=drafter)
        return drafter
