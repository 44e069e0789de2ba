"""PPOW adaptive windows: the window rule, and its hook for Hugging Face assisted generation.

This file is the one definition of PPOW's window-length rule. ``ppow_trl.core.windowing`` imports it,
``ppow_trl.serving.assisted.attach_window_policy`` (and so ``load_assistant``) installs its ``generate`` in memory, and
``ppow_trl.serving.assisted.save_assistant`` copies it verbatim into a drafter folder as ``custom_generate/generate.py``.
It imports only the standard library, torch and transformers (never ppow_trl): a folder loaded with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` where ppow_trl is not installed still
applies the same rule.

The online guard (``SpeculationGuard``, ``WindowBudget``) lives here too, next to the rule it pauses: within one
generation, drafting stops for a while when the rounds stop paying, and probes again (see the class).

The rule: after the i-th drafted token, keep drafting while ``prod_{j<=i} conf_j >= h`` and ``i < K``, with
``conf_j = max_v softmax(z_j / T_c)(v)``: the drafter's logits ``z_j`` at the policy's confidence temperature
``T_c``, whatever the decoding temperature (greedy drafting still needs real confidences: a one-hot ``q``
would always give 1). The first token is always drafted; the token that pushes the product below ``h`` is
still proposed (it may be accepted) and ends the window.

The hook (``generate(*args, model, **kwargs)``, installed as ``functools.partial(generate, model=drafter)``).
transformers' assisted loop (``target.generate(..., assistant_model=drafter)``) calls the drafter's ``generate``
once per round with a copy of the target's generation config marked ``is_assistant=True`` (``output_scores=True``,
``return_dict_in_generate=True``) and the target's logits processors. Only then does the hook act; called
directly, the drafter generates as usual. It

- reads ``K``, ``h`` and ``T_c`` from ``model.generation_config.ppow_window_policy`` (else from
  ``ppow_window_policy.json`` next to the weights; ``T_c`` = 1.0 when absent, as in folders saved before it
  existed);
- turns off HF's own per-token ``assistant_confidence_threshold`` rule, and, when sampling, the config's copy of
  the sampling warpers that are already in the target's processor list (transformers 5.24 would otherwise warp
  the drafter twice, i.e. draft at ``T^2``), so the drafter drafts at the target's temperature, once;
- adds ``PPOWWindowCriteria``, the stopping criterion that applies the rule, then calls the model class's own
  ``generate``. HF verifies the drafted tokens as usual, so the output stays lossless whatever the lengths.

Confidences from what the criterion sees. A stopping criterion gets the drafter's *processed* scores: greedy,
the raw logits ``z`` (``s = 1``); sampling, ``z / T`` after ``TemperatureLogitsWarper`` (``s = T``, the
sampling temperature ``generation_config.temperature``; ``_applied_temperature`` takes it from the processors
that really run). The criterion computes ``window_confidence(scores * s, T_c)``, so
``z / T_c`` is recovered and the window lengths are those ``ppow_trl`` computes from raw logits elsewhere.
With other processors in effect the confidences are those of the processed scores: under top-k / top-p
(transformers' default when sampling is ``top_k=50``) they are those of the *truncated* distribution (removed
entries are ``-inf``, probability 0, and the remaining ones are renormalised), and a repetition penalty or
similar processor shifts them too. Pass ``top_k=0`` (and no ``top_p``) to get exactly the rule of training.

What running this file does (it is what ``trust_remote_code=True`` executes): importing it imports ``copy``,
``json``, ``os``, ``torch`` and transformers' stopping criteria, and defines the functions and classes below;
nothing else happens at import. Calling the hook may read ``ppow_window_policy.json`` next to the weights (a
local file), copies the generation config and calls the model's own ``generate``; for a guarded drafter (a
``WindowBudget`` in its generation config, which ``ppow_trl.serving.assisted.load_assistant`` installs: the guard needs
ppow_trl) it also runs one drafter forward over the ids decoded plainly during a pause. It never touches the network,
writes no file and starts no process.
"""

import copy
import json
import os
import warnings

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

__all__ = ["window_confidence", "keep_drafting", "PPOWWindowCriteria", "SpeculationGuard", "WindowBudget",
           "ppow_window_policy", "generate"]

PPOW_WINDOW_POLICY_FILE = "ppow_window_policy.json"
PPOW_GENERATION_CONFIG_KEY = "ppow_window_policy"


def window_confidence(logits: torch.Tensor, confidence_temperature: float = 1.0) -> torch.Tensor:
    """``conf = max_v softmax(z / T_c)(v)`` over the last dimension of the drafter's logits ``z``.

    Entries at ``-inf`` (rows outside a reduced draft vocabulary, or removed by top-k/top-p) get probability 0.
    """
    if confidence_temperature <= 0:
        raise ValueError(f"confidence_temperature (T_c) must be > 0, got {confidence_temperature}.")
    return torch.softmax(logits.float() / confidence_temperature, dim=-1).amax(dim=-1)


def keep_drafting(running_acceptance, num_drafted: int, max_window: int, threshold: float):
    """Whether to draft another token after ``num_drafted`` tokens whose running estimate is
    ``running_acceptance = prod_{j<=num_drafted} conf_j``: ``running >= h and num_drafted < K``."""
    return (running_acceptance >= threshold) & (num_drafted < max_window)


class PPOWWindowCriteria(StoppingCriteria):
    """The window rule for one drafting call of HF's assisted loop (see the module docstring).

    Args:
        max_window (`int`): ``K``.
        threshold (`float`): ``h``.
        confidence_temperature (`float`): ``T_c`` of the confidences.
        do_sample (`bool`): whether the drafter samples, i.e. whether its scores were divided by ``temperature``.
        temperature (`float`): the temperature applied to the scores when sampling (``s``); ignored when greedy.
        vocab_size (`int`, *optional*): confidences over the first ``vocab_size`` scores only (the tokenizer's
            tokens, as every other route computes them; a head may have padding rows beyond).

    ``scores`` is the tuple of processed scores of this ``generate`` call (one ``(batch, vocab)`` entry per drafted
    token); HF's assisted loop always asks the drafter for them (``output_scores=True``).
    """

    def __init__(self, max_window, threshold, confidence_temperature=1.0, do_sample=False, temperature=1.0,
                 vocab_size=None):
        max_window, threshold = int(max_window), float(threshold)
        confidence_temperature, temperature = float(confidence_temperature), float(temperature)
        if max_window < 1 or not 0.0 <= threshold <= 1.0 or not confidence_temperature > 0:
            raise ValueError(
                f"Invalid PPOW window policy: K={max_window} (need >= 1), h={threshold} (need [0, 1]), "
                f"T_c={confidence_temperature} (need > 0)."
            )
        if do_sample and not temperature > 0:
            raise ValueError(f"The sampling temperature must be > 0, got {temperature}.")
        self.max_window = max_window
        self.threshold = threshold
        self.confidence_temperature = confidence_temperature
        self.score_scale = temperature if do_sample else 1.0
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.running = None
        self.num_drafted = 0

    def __call__(self, input_ids, scores, **kwargs):
        if scores is None:
            raise ValueError(
                "The PPOW window rule needs the drafter's scores: call generate with output_scores=True and "
                "return_dict_in_generate=True (HF's assisted generation does)."
            )
        while self.num_drafted < len(scores):
            logits = scores[self.num_drafted].float()
            if self.vocab_size is not None:
                logits = logits[..., : self.vocab_size]
            if self.score_scale != 1.0:
                logits = logits * self.score_scale  # z / T -> z (-inf entries stay -inf)
            confidence = window_confidence(logits, self.confidence_temperature)
            self.running = confidence if self.running is None else self.running * confidence
            self.num_drafted += 1
        keep = keep_drafting(self.running, self.num_drafted, self.max_window, self.threshold)
        return ~keep.to(input_ids.device)


GUARD_LEGACY_KEYS = ("window", "margin")
"""Settings of the windowed guard that rules saved before the loss-budget guard carry; ignored on load."""


class SpeculationGuard:
    """The online guard of one generation: pause drafting once speculation has lost a budget of time, probe to resume.

    A drafting round that drafted ``L`` tokens, ``F`` of them free (a hybrid's lookups: no drafter forward), costs

        ``c(L, F) = round_costs[L] - F * free_token_saving``  target steps

(an empty round of ``empty_windows``, ``L = 0``, that ran the drafter for the first token it dropped costs
``round_costs[0] + free_token_saving``)

    (``round_costs[L] = CostModel.round_time(L)``, ``(L t_d + t_v(L) + o_r + L o_d) / (1 + o_0)``, measured on the
    serving runtime and saved with the rule; ``free_token_saving = t_d / (1 + o_0)``). It yields ``A + 1`` tokens,
    so against plain decoding it gains ``A + 1 - c`` steps. The guard keeps the time speculation has lost since it
    last broke even, a one-sided CUSUM on that gain (Page, 1954):

        ``S_n = max(0, S_{n-1} + c(L_n, F_n) - (A_n + 1))``,  pause when ``S_n > H`` (``loss_budget``, in target steps).

    Why each round's own cost and not the rule's mean: the rule's windows are as long as the drafter is confident,
    and on new text that is not the calibration's mix. Charged the calibration's mean round, rounds of longer windows
    than the calibration's lose unseen (a rule whose calibrated rounds cost 1.08 steps, mostly one drafted token,
    seems to gain on rounds of three drafted tokens that cost 1.40 steps and yield 1.2 tokens). A rule saved without
    ``round_costs`` charges every drafting round ``break_even_tokens``.

    Why a budget and not a window mean: a rule that pays on average has misses in a row by chance (K = 1 at first-token
    acceptance 0.19 misses 8 rounds in a row with probability 0.19), and a window mean under ``b`` paused it on that
    noise; the calibration sets ``H`` from the rule's own spread of ``A`` (``ppow_trl.serving.calibration.guard_for_rule``,
    5 standard deviations, at least two missed rounds), so a drafter that pays is paused less often and for less
    (a marginal K = 1 rule at 1.07x still spends about 15% of its rounds paused, at 1% of its speedup) while one whose
    acceptance collapsed pauses after losing about ``H`` steps. A proposer that costs nothing to run (prompt lookup,
    ``c ~ 1``) loses little per miss and is paused late, as it should: pausing it would save little and forfeit the
    next hits.

    While paused, ``pause`` rounds decode plainly (``K = 0``: one target forward, one token); then drafting resumes with
    half the budget already spent (``S = H / 2``, a fast-initial-response CUSUM): a drafter that still loses pauses
    again after losing ``H / 2`` more, and the pause doubles (up to ``max_pause``); a resumption holds when ``S``
    comes back to 0 or lasts ``probe_every`` drafting rounds, and the next pause is ``probe_every`` again.

    One protocol on every route, fixed by what Hugging Face's assisted loop can know: a route calls ``decide()``
    once at the start of every round (plain ones included), and, when a drafting round starts, ``record(A, L, F)``
    for the previous drafting round (HF's hook learns ``A`` only then, from the committed ids).
    An outcome thus weighs from the second decision after its round on; the round that was being drafted when a
    pause began is not counted. Exact greedy tau (``exact_greedy_tau``) replays the guard with the window lengths of
    its teacher-forced confidences, which are the served ones whenever a window ends at most one token after its
    first rejected token (always with ``h = 0``); the hybrid's replay charges its lookups as drafted.
    """

    def __init__(self, break_even_tokens: float, loss_budget: float = 3.0, probe_every: int = 32,
                 max_pause: int = 512, round_costs: list[float] | None = None, free_token_saving: float = 0.0,
                 across_generations: bool = False):
        costs_ok = round_costs is None or (len(round_costs) >= 2 and all(c > 0 for c in round_costs))
        if (not break_even_tokens > 0 or not loss_budget > 0 or int(probe_every) < 1
                or int(max_pause) < int(probe_every) or not costs_ok or not free_token_saving >= 0):
            raise ValueError(f"Invalid speculation guard: break_even_tokens={break_even_tokens} (need > 0), "
                             f"loss_budget={loss_budget} (need > 0), probe_every={probe_every} (need >= 1), "
                             f"max_pause={max_pause} (need >= probe_every), round_costs={round_costs} (need None or "
                             f"positive costs for L = 0..K, K >= 1), free_token_saving={free_token_saving} (need >= 0).")
        self.break_even_tokens, self.loss_budget = float(break_even_tokens), float(loss_budget)
        self.probe_every, self.max_pause = int(probe_every), int(max_pause)
        self.round_costs = None if round_costs is None else [float(c) for c in round_costs]
        self.free_token_saving = float(free_token_saving)
        self.across_generations = bool(across_generations)
        self.reset()

    @classmethod
    def from_settings(cls, settings: dict) -> "SpeculationGuard":
        """The guard of a saved rule's ``guard`` dict (the windowed guard's ``window`` and ``margin`` are ignored)."""
        legacy = [key for key in GUARD_LEGACY_KEYS if key in settings]
        if legacy and "loss_budget" not in settings:
            warnings.warn(f"This rule was saved with the windowed online guard ({', '.join(legacy)}): it runs with the "
                          f"loss-budget guard at the default budget of {cls.__init__.__defaults__[0]} steps. Calibrate "
                          "it again (ppow_trl.serving.rule.calibrate_for_serving) for a budget from its own spread.",
                          stacklevel=2)
        return cls(**{key: value for key, value in settings.items() if key not in GUARD_LEGACY_KEYS})

    def new_generation(self) -> None:
        """A generation starts: ``reset()``, or with ``across_generations`` only the generation's own bookkeeping, so
        that the time lost, a pause under way and its length carry over from the generations before (one served
        rule meets one kind of traffic: a drafter that lost on the last answers starts the next one paused, instead
        of losing the budget again on every answer; short answers are where a budget of several steps weighs)."""
        if not self.across_generations:
            self.reset()
            return
        self.ignore_next = False  # the round drafted as a pause began ended with its generation
        self.decisions = []
        self.last_window = None

    def reset(self) -> None:
        """Speculating, nothing lost (a new generation without ``across_generations``)."""
        self.lost = 0.0  # S: target steps lost against plain decoding since speculation last broke even
        self.paused_left = 0
        self.pause = self.probe_every  # length of the next pause
        self.resumed = False  # drafting again after a pause, and the resumption has not held yet
        self.resumed_rounds = 0  # drafting rounds counted since the resumption
        self.ignore_next = False
        self.decisions = []  # per round, True = drafted (for inspection and tests)
        self.last_window = None  # HF's routes: (committed length, drafted ids, free ones) of the last drafting call

    def decide(self) -> bool:
        """Whether this round drafts (call once at the start of every round)."""
        if self.paused_left > 0:
            self.paused_left -= 1
            draft = False
        else:
            draft = True
        self.decisions.append(draft)
        return draft

    def round_cost(self, drafted: int | None = None, free: int = 0) -> float:
        """``c(L, F)`` in target steps: ``round_costs[L] - F * free_token_saving`` (``break_even_tokens`` when the rule
        has no table or the length is not known); lengths past the table cost its last step more per token."""
        if self.round_costs is None or drafted is None:
            return self.break_even_tokens
        costs, drafted = self.round_costs, int(drafted)
        last = len(costs) - 1
        cost = costs[drafted] if drafted <= last else costs[last] + (drafted - last) * (costs[last] - costs[last - 1])
        return max(cost - int(free) * self.free_token_saving, 0.0)

    def record(self, accepted: int, drafted: int | None = None, free: int = 0, dropped: int = 0) -> None:
        """The previous drafting round, given when the next drafting round starts: its accepted length ``A``, how many
        tokens it drafted (``L``), how many of those came free (``F``, a hybrid's lookups), and how many drafter
        steps it spent on a token it then dropped (``D``: an empty window's first token, charged
        ``free_token_saving`` each)."""
        if self.ignore_next:  # drafted while the pause was being decided: not counted
            self.ignore_next = False
            return
        cost = self.round_cost(drafted, free) + int(dropped) * self.free_token_saving
        self.lost = max(0.0, self.lost + cost - (int(accepted) + 1))
        self.resumed_rounds += 1
        if self.resumed and (self.lost == 0.0 or self.resumed_rounds >= self.probe_every):
            # back at break-even, or drafting as long as a pause lasts: the resumption held (a rule that pays
            # little takes long to reach 0 from H / 2, and must not be held back like one that lost again)
            self.resumed, self.pause = False, self.probe_every
        if self.lost > self.loss_budget:
            self._pause()

    def drafting_call(self, committed) -> int | None:
        """HF's routes: a drafting round starts after the ``committed`` ids (a list); record the previous window's
        ``A``, its leading matches with what was committed (exact: a rejected token is never the one committed in
        its place, greedy or sampled, as the residual ``max(p - q, 0)`` is 0 there). Returns how many leading ids
        the drafter's state can keep (the previous start plus ``A``; ``None`` on the first call)."""
        if self.last_window is None:
            return None
        start, drafted, free = self.last_window
        accepted = 0
        for token, kept in zip(drafted, committed[start : start + len(drafted)]):
            if token != kept:
                break
            accepted += 1
        self.record(accepted, len(drafted), free)
        self.last_window = None
        return start + accepted

    def drafted(self, start: int, tokens, free: int = 0) -> None:
        """HF's routes: the window just proposed after ``start`` committed ids, ``free`` of its tokens proposed without
        a drafter forward (read back at the next call)."""
        self.last_window = (int(start), [int(t) for t in tokens], int(free))

    def _pause(self) -> None:
        if self.resumed:  # the last resumption lost again: wait longer before the next
            self.pause = min(2 * self.pause, self.max_pause)
        self.paused_left = self.pause
        self.lost = self.loss_budget / 2  # resume with half the budget spent
        self.resumed, self.resumed_rounds = True, 0
        self.ignore_next = True  # the round being drafted now began before the pause


class WindowBudget(int):
    """``num_assistant_tokens`` of a guarded drafter: ``K`` when written, ``K`` or 0 when HF's loop reads it.

    transformers' assisted loop reads ``int(num_assistant_tokens)`` once per round and asks the drafter for no
    candidate when it is 0, so a 0 from ``SpeculationGuard.decide()`` is a plain decoding round: one target
    forward, no drafter forward. It serialises as ``K``; copies (HF deep-copies the drafter's generation config
    per ``generate`` call, when it builds its candidate generator) share the guard, and that copy starts a new
    generation (``SpeculationGuard.new_generation``).
    """

    def __new__(cls, max_window: int, guard: SpeculationGuard):
        budget = super().__new__(cls, int(max_window))
        budget.guard = guard
        return budget

    def __int__(self):
        return int.__int__(self) if self.guard.decide() else 0

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        self.guard.new_generation()  # AssistedCandidateGenerator.__init__: a new generate call
        return self

    def __reduce__(self):
        return int, (int.__int__(self),)


def ppow_window_policy(model):
    """``{"max_window": K, "threshold": h, "confidence_temperature": T_c}`` of ``model``.

    From ``model.generation_config.ppow_window_policy``, else from ``ppow_window_policy.json`` next to its weights;
    ``confidence_temperature`` is 1.0 when the policy has none (saved before it existed).
    """
    policy = getattr(getattr(model, "generation_config", None), PPOW_GENERATION_CONFIG_KEY, None)
    if policy is None:
        path = os.path.join(str(getattr(model, "name_or_path", "") or ""), PPOW_WINDOW_POLICY_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                policy = json.load(f)
    if policy is None:
        raise ValueError(
            f"This drafter has no PPOW window policy: neither `generation_config.{PPOW_GENERATION_CONFIG_KEY}` nor "
            f"{PPOW_WINDOW_POLICY_FILE} next to its weights. Save it with ppow_trl.serving.assisted.save_assistant."
        )
    return {
        "max_window": int(policy["max_window"]),
        "threshold": float(policy["threshold"]),
        "confidence_temperature": float(policy.get("confidence_temperature", 1.0)),
        "vocab_size": None if policy.get("vocab_size") is None else int(policy["vocab_size"]),
    }


# Sampling warpers `generate` adds from the generation config, by class name -> the setting that disables it.
_WARPER_SETTINGS = {
    "TemperatureLogitsWarper": ("temperature", 1.0),
    "TopKLogitsWarper": ("top_k", 0),
    "TopPLogitsWarper": ("top_p", 1.0),
    "MinPLogitsWarper": ("min_p", 0.0),  # not None: generate() would refill None from the drafter's config
    "TypicalLogitsWarper": ("typical_p", 1.0),
    "EpsilonLogitsWarper": ("epsilon_cutoff", 0.0),
    "EtaLogitsWarper": ("eta_cutoff", 0.0),
    "TopHLogitsWarper": ("top_h", None),
}


def _assistant_generation_config(generation_config, logits_processor):
    """The config HF passes, minus what would cut our windows or warp the drafter twice.

    - HF's own per-token ``assistant_confidence_threshold`` rule: our rule replaces it.
    - Sampling: the ``logits_processor`` HF passes is the target's, warpers included, and ``generate`` adds the
      warpers of the (same) config again, so the drafter would sample at ``T^2`` (transformers 5.24). Turning the
      config's copy of each warper already in the list off makes the drafter sample from exactly the processing
      the target applies (``T`` once), as ppow_trl's own loop and training do. Lossless either way: HF verifies
      against the scores the drafter really sampled from.
    """
    changes = {}
    if getattr(generation_config, "assistant_confidence_threshold", None):
        changes["assistant_confidence_threshold"] = 0.0
    if getattr(generation_config, "do_sample", False):
        for processor in logits_processor or []:
            setting = _WARPER_SETTINGS.get(type(processor).__name__)
            if setting is not None and hasattr(generation_config, setting[0]):
                changes[setting[0]] = setting[1]
    if not changes:
        return generation_config
    generation_config = copy.copy(generation_config)
    for name, value in changes.items():
        setattr(generation_config, name, value)
    return generation_config


def _applied_temperature(generation_config, logits_processor, model):
    """The temperature the sampling drafter's scores are divided by: that of the temperature warpers in the
    processor list HF passes, times that of the warper ``generate`` adds from ``generation_config`` (the config
    returned by ``_assistant_generation_config``; a ``None`` is refilled from the drafter's own config, then 1).
    In transformers 5.24 this is ``T`` from the list and 1 from the config, i.e. the target's ``temperature``."""
    temperature = 1.0
    for processor in logits_processor or []:
        if type(processor).__name__ == "TemperatureLogitsWarper":
            temperature *= float(processor.temperature)
    from_config = getattr(generation_config, "temperature", None)
    if from_config is None:
        from_config = getattr(getattr(model, "generation_config", None), "temperature", None)
    return temperature * (1.0 if from_config is None else float(from_config))


def generate(*args, model, **kwargs):
    """``model.generate``, plus the PPOW window rule when HF's assisted loop calls ``model`` as its assistant."""
    generation_config = kwargs.get("generation_config")
    if generation_config is not None and getattr(generation_config, "is_assistant", False):
        policy = ppow_window_policy(model)
        logits_processor = kwargs.get("logits_processor")
        do_sample = bool(getattr(generation_config, "do_sample", False))
        generation_config = _assistant_generation_config(generation_config, logits_processor)
        kwargs["generation_config"] = generation_config
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(
            PPOWWindowCriteria(
                policy["max_window"],
                policy["threshold"],
                confidence_temperature=policy["confidence_temperature"],
                do_sample=do_sample,
                temperature=_applied_temperature(generation_config, logits_processor, model) if do_sample else 1.0,
                vocab_size=policy["vocab_size"],
            )
        )
        kwargs["stopping_criteria"] = criteria
        guard = guard_of(model)
        if guard is not None:
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            _catch_up(model, input_ids, kwargs.get("cache"), guard.drafting_call(input_ids[0].tolist()))
            if kwargs.get("cache") is None:
                _extend_prompt_masks(kwargs, input_ids.shape[1])
            # The drafter's own generate deep-copies its config: a plain K there, so that only HF's candidate
            # generator (built once per target.generate call) resets the guard.
            budget = model.generation_config.num_assistant_tokens
            model.generation_config.num_assistant_tokens = int.__int__(budget)
            try:
                output = type(model).generate(model, *args, **kwargs)
            finally:
                model.generation_config.num_assistant_tokens = budget
            guard.drafted(input_ids.shape[1], output.sequences[0, input_ids.shape[1] :].tolist())
            return output
    # The class's generate (GenerationMixin's or the model's override), not this instance's replacement.
    return type(model).generate(model, *args, **kwargs)


def _extend_prompt_masks(kwargs: dict, length: int) -> None:
    """The generation's first drafting call came after plain rounds (a pause carried over from the last generation,
    ``SpeculationGuard.across_generations``): HF's loop (transformers 5.25) extends the drafter's attention mask and
    position ids only once the drafter has a cache, so they still cover the prompt alone. The ids decoded plainly
    since are real tokens at the next positions."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.shape[-1] < length:
        kwargs["attention_mask"] = torch.cat([mask, mask.new_ones(mask.shape[0], length - mask.shape[-1])], dim=-1)
    positions = kwargs.get("position_ids")
    if positions is not None and positions.shape[-1] < length:
        extra = torch.arange(1, length - positions.shape[-1] + 1, dtype=positions.dtype, device=positions.device)
        kwargs["position_ids"] = torch.cat([positions, positions[..., -1:] + extra], dim=-1)


@torch.no_grad()
def _catch_up(model, input_ids, cache, valid: int | None) -> None:
    """After paused rounds, give the drafter's cache the state HF's loop expects: the committed ids up to
    ``len(input_ids) - 2``.

    HF's loop (transformers 5.24) crops the drafter's cache to ``len - 2`` before each drafting call only when it
    is longer, and feeds the last two ids. After paused rounds the cache still ends with the last window's
    rejected drafts and misses what was decoded plainly, so the call would draft from a wrong state (lossless, but
    worse drafts). Cropping to the ``valid`` prefix and one forward over the missed ids restore it.
    """
    if cache is None or valid is None:
        return
    if cache.get_seq_length() > valid:
        cache.crop(valid - cache.get_seq_length())  # a negative count: drop that many
    length, target = cache.get_seq_length(), input_ids.shape[1] - 2
    if length < target:
        model(input_ids=input_ids[:, length:target].to(model.device), cache=cache, use_cache=True,
              logits_to_keep=1)


def guard_of(model):
    """The ``SpeculationGuard`` behind ``model.generation_config.num_assistant_tokens``, if it is guarded."""
    budget = getattr(getattr(model, "generation_config", None), "num_assistant_tokens", None)
    return budget.guard if isinstance(budget, WindowBudget) else None
