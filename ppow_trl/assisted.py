"""PPOW drafters in Hugging Face's own assisted generation: ``target.generate(..., assistant_model=drafter)``.

Route (transformers 5.24, checked in its ``generation/candidate_generator.py`` and ``generation/utils.py``):

- HF's assisted loop (``_assisted_decoding`` + ``AssistedCandidateGenerator``) reads its window settings
  from the *drafter's* ``generation_config`` (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
  ``assistant_confidence_threshold``, default 0.4), never from arguments to ``target.generate``, and has no
  ``candidate_generator=`` argument. Every round it calls ``drafter.generate(input_ids=...,
  max_new_tokens=min(num_assistant_tokens, room left), generation_config=<copy of the target's config with
  is_assistant=True, output_scores=True, return_dict_in_generate=True>, logits_processor=<the target's>,
  cache=..., attention_mask=...)`` and uses the returned ``scores`` as the drafter distributions ``q``.
- ``from_pretrained(folder, trust_remote_code=True)`` on a folder holding ``custom_generate/generate.py``
  replaces the loaded model's ``generate`` with ``functools.partial(generate, model=model)``.

So ``save_assistant`` sets the drafter's generation config for HF (``num_assistant_tokens = K``, schedule
``"constant"`` so HF never changes K, ``assistant_confidence_threshold = 0``: HF's per-token rule and its
ROC-based re-tuning are off) and writes ``custom_generate/generate.py``, whose ``generate`` adds, only when
HF calls it as an assistant (``generation_config.is_assistant``), a stopping criterion implementing our
running-product rule (``AdaptiveWindowPolicy``): after the ``i``-th drafted token, stop unless
``prod_{j<=i} max_v q_j(v) >= h`` and ``i < K``. So the first token is always drafted and the token that
pushes the product below ``h`` is still proposed. ``q_j = softmax(scores_j)``, where ``scores_j`` are the
drafter's logits after the target's logits processors, i.e. exactly the distribution HF's loop drafts from
and verifies against: greedy (``do_sample=False``, no processors) gives ``softmax(logits)`` (T = 1, as in
``ppow_trl.generation``); sampling gives ``softmax(logits / T)`` at the sampling temperature (after any
top-k/top-p the user set). (Stock transformers 5.24 warps the drafter twice when sampling: the processor list
HF passes to the drafter is the target's, warpers included, and the drafter's ``generate`` adds the same
warpers again from the same config, so the drafter would draft at ``T^2``. The hook switches the second copy
off, so the drafter drafts at ``T`` as in ``ppow_trl.generation`` and in PPOW training.) The rule only
decides *how many* tokens are proposed; HF verifies them as usual, so the output stays lossless (greedy: the
target's own greedy text; sampling: the target's distribution) whatever the window lengths.

Why this route: it is HF's documented hook, works for any drafter class (plain causal LMs and
``PPOWDrafterForCausalLM`` alike) without subclassing, keeps HF's candidate generator, caches and
verification untouched, and the folder carries its policy (``ppow_window_policy.json``, also copied into
``generation_config.json``) and cost model (``ppow_cost_model.json``). ``target.generate(custom_generate=...)``
would not do: it replaces the whole decoding loop and does not forward ``assistant_model``.

What the user writes::

    import ppow_trl  # only needed for reduced-vocabulary drafters (PPOWDrafterForCausalLM), see below
    drafter = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # or load_assistant(folder)
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=256)

- ``trust_remote_code=True`` is required: it is what makes transformers run ``custom_generate/generate.py``.
  Without it the drafter still works as an HF assistant but with a fixed window of ``K`` tokens (the
  generation config's ``num_assistant_tokens``), not our adaptive rule. Passing ``generation_config=`` to
  ``from_pretrained`` also skips the hook (transformers only loads it from the folder); ``load_assistant``
  installs it in every case.
- ``custom_generate/generate.py`` needs only torch and transformers (not ppow_trl).
- A ``PPOWDrafterForCausalLM`` folder (``model_type = "ppow_drafter"``, reduced vocabulary) also gets
  ``modeling_ppow_drafter.py`` (a copy of ``ppow_trl/drafter.py`` without its Auto-class registration) and an
  ``auto_map`` in ``config.json``, so ``trust_remote_code=True`` loads it even where ppow_trl is not installed.
  Where ppow_trl *is* imported first, transformers prefers the classes ppow_trl registered (a non-transformers
  local registration beats ``auto_map``: ``explicit_local_code`` in ``auto_factory.py``), so the model is a real
  ``ppow_trl.PPOWDrafterForCausalLM``. Import ppow_trl before loading if you also pass the drafter to ppow_trl
  functions: a model built from the copied class fails their ``isinstance`` checks.
- Batch size 1 only (HF's assisted decoding refuses larger batches).
- HF also ends a window at EOS (the target's EOS; the drafter's own when the target has none), and caps it at
  the room left before ``max_new_tokens`` (``ppow_trl.generation`` uses the same cap). Any other stopping
  criterion the user passes to ``target.generate`` applies to the target only.
- A PEFT adapter folder (what ``PPOWTrainer`` writes when it trains a LoRA) holds the policy, cost model and
  ``custom_generate`` files, but HF loads an adapter through its base model's folder, so the hook and the
  window settings only apply after merging: ``save_assistant(peft_model.merge_and_unload(), folder, ...)``.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict
from pathlib import Path

from .cost import COST_MODEL_FILE, CostModel
from .windowing import WINDOW_POLICY_FILE, AdaptiveWindowPolicy

CUSTOM_GENERATE_FILE = "custom_generate/generate.py"
GENERATION_CONFIG_KEY = "ppow_window_policy"
"""Attribute of the drafter's ``generation_config`` (and key of ``generation_config.json``) holding ``K, h``."""

# The source of `custom_generate/generate.py`. Kept as text so that the file written into a drafter folder
# and the hook `attach_window_policy` installs in memory are the same code (it is exec'd below).
GENERATE_PY = '''\
"""PPOW adaptive windows for Hugging Face assisted generation (written by ppow_trl.assisted).

transformers runs this file when the drafter is loaded with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`: the drafter's `generate` becomes
`functools.partial(generate, model=drafter)`. When the target's assisted loop
(`target.generate(..., assistant_model=drafter)`) asks the drafter for a window, this adds a stopping
criterion: after the i-th drafted token, stop unless prod_{j<=i} max_v q_j(v) >= h and i < K, where
q_j = softmax of the drafter's processed scores (the distribution HF drafts from and verifies against).
The first token is always drafted; the token that pushes the product below h is still proposed.
K and h come from `generation_config.ppow_window_policy` (else from ppow_window_policy.json next to the
weights). Called directly (not as an assistant), the drafter generates as usual.
Needs only torch and transformers.
"""

import copy
import json
import os

import torch
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

PPOW_WINDOW_POLICY_FILE = "ppow_window_policy.json"
PPOW_GENERATION_CONFIG_KEY = "ppow_window_policy"


class PPOWWindowCriteria(StoppingCriteria):
    """Running-product window rule of ppow_trl's AdaptiveWindowPolicy, for one drafting call.

    `scores` is the tuple of processed scores of this `generate` call (one entry per drafted token); HF's
    assisted loop always asks the drafter for them (`output_scores=True`).
    """

    def __init__(self, max_window, threshold):
        max_window, threshold = int(max_window), float(threshold)
        if max_window < 1 or not 0.0 <= threshold <= 1.0:
            raise ValueError(f"Invalid PPOW window policy: K={max_window} (need >= 1), h={threshold} (need [0, 1]).")
        self.max_window = max_window
        self.threshold = threshold
        self.running = None
        self.num_drafted = 0

    def __call__(self, input_ids, scores, **kwargs):
        if scores is None:
            raise ValueError(
                "The PPOW window rule needs the drafter's scores: call generate with output_scores=True and "
                "return_dict_in_generate=True (HF's assisted generation does)."
            )
        while self.num_drafted < len(scores):
            confidence = torch.softmax(scores[self.num_drafted].float(), dim=-1).amax(dim=-1)
            self.running = confidence if self.running is None else self.running * confidence
            self.num_drafted += 1
        keep = (self.running >= self.threshold) & (self.num_drafted < self.max_window)
        return ~keep.to(input_ids.device)


def ppow_window_policy(model):
    """`{"max_window": K, "threshold": h}` of `model`: its generation config, else its folder's JSON file."""
    policy = getattr(getattr(model, "generation_config", None), PPOW_GENERATION_CONFIG_KEY, None)
    if policy is None:
        path = os.path.join(str(getattr(model, "name_or_path", "") or ""), PPOW_WINDOW_POLICY_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                policy = json.load(f)
    if policy is None:
        raise ValueError(
            f"This drafter has no PPOW window policy: neither `generation_config.{PPOW_GENERATION_CONFIG_KEY}` nor "
            f"{PPOW_WINDOW_POLICY_FILE} next to its weights. Save it with ppow_trl.assisted.save_assistant."
        )
    return {"max_window": int(policy["max_window"]), "threshold": float(policy["threshold"])}


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

    - HF's own per-token `assistant_confidence_threshold` rule: our rule replaces it.
    - Sampling: the `logits_processor` HF passes is the target's, warpers included, and `generate` adds the
      warpers of the (same) config again, so the drafter would sample at T^2 (transformers 5.24). Turning the
      config's copy of each warper already in the list off makes the drafter sample from exactly the processing
      the target applies (T once), as ppow_trl's own loop and training do. Lossless either way: HF verifies
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


def generate(*args, model, **kwargs):
    generation_config = kwargs.get("generation_config")
    if generation_config is not None and getattr(generation_config, "is_assistant", False):
        policy = ppow_window_policy(model)
        kwargs["generation_config"] = _assistant_generation_config(generation_config, kwargs.get("logits_processor"))
        criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
        criteria.append(PPOWWindowCriteria(policy["max_window"], policy["threshold"]))
        kwargs["stopping_criteria"] = criteria
    # The class's generate (GenerationMixin's or the model's override), not this instance's replacement.
    return type(model).generate(model, *args, **kwargs)
'''


@functools.lru_cache(maxsize=1)
def _hook() -> dict:
    """The namespace of ``GENERATE_PY`` run in memory (for drafters whose ``generate`` is not the folder's)."""
    namespace: dict = {"__name__": "ppow_trl_custom_generate"}
    exec(compile(GENERATE_PY, "<ppow_trl custom_generate/generate.py>", "exec"), namespace)
    return namespace


def _check_policy(policy) -> AdaptiveWindowPolicy:
    if not isinstance(policy, AdaptiveWindowPolicy):
        raise ValueError(f"policy must be an AdaptiveWindowPolicy, got {type(policy).__name__}.")
    return policy


def configure_generation_config(generation_config, policy: AdaptiveWindowPolicy):
    """Set a drafter's ``generation_config`` for HF's assisted generation with our rule; returns it.

    ``num_assistant_tokens = K`` (HF drafts at most this many), ``num_assistant_tokens_schedule = "constant"``
    (HF never changes K), ``assistant_confidence_threshold = 0`` (HF's per-token rule and its re-tuning are
    off), and ``ppow_window_policy = {"max_window": K, "threshold": h}`` (read by the custom ``generate``).
    """
    policy = _check_policy(policy)
    generation_config.num_assistant_tokens = policy.max_window
    generation_config.num_assistant_tokens_schedule = "constant"
    generation_config.assistant_confidence_threshold = 0.0
    setattr(generation_config, GENERATION_CONFIG_KEY, asdict(policy))
    return generation_config


def attach_window_policy(drafter, policy: AdaptiveWindowPolicy):
    """In memory, without saving: make ``drafter`` apply ``policy`` as an HF assistant; returns ``drafter``.

    Sets its generation config (``configure_generation_config``) and replaces its ``generate`` with the
    same hook ``custom_generate/generate.py`` holds, as ``from_pretrained(trust_remote_code=True)`` would.
    """
    if _is_peft_model(drafter):
        raise ValueError(_PEFT_MESSAGE)
    configure_generation_config(drafter.generation_config, policy)
    drafter.generate = functools.partial(_hook()["generate"], model=drafter)
    return drafter


def _is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # peft is optional
        return False
    return isinstance(model, PeftModel)


_PEFT_MESSAGE = (
    "A PEFT adapter cannot carry the window hook: HF loads an adapter through its base model's folder, so neither "
    "custom_generate/generate.py nor the generation config of the adapter folder is used. Merge the adapter first "
    "(`drafter = peft_model.merge_and_unload()`) and save the merged drafter with ppow_trl.assisted.save_assistant."
)


def save_assistant(
    drafter,
    folder,
    *,
    policy: AdaptiveWindowPolicy,
    cost_model: CostModel | None = None,
    tokenizer=None,
) -> Path:
    """Save ``drafter`` so that ``target.generate(..., assistant_model=<loaded drafter>)`` applies ``policy``.

    Writes the weights and config (``drafter.save_pretrained``), the tokenizer if given, and
    ``write_assistant_files``: ``ppow_window_policy.json``, ``ppow_cost_model.json`` (if ``cost_model``),
    ``generation_config.json`` set for HF (``configure_generation_config``; the in-memory drafter's config is
    set too) and ``custom_generate/generate.py``. Reload with ``load_assistant(folder)`` or
    ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` (after ``import ppow_trl`` for a
    ``PPOWDrafterForCausalLM``). A PEFT model is refused: merge it first (``merge_and_unload()``).
    Returns the folder as a ``Path``.
    """
    policy = _check_policy(policy)
    if _is_peft_model(drafter):
        raise ValueError(_PEFT_MESSAGE)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel or None, got {type(cost_model).__name__}.")
    folder = Path(folder)
    configure_generation_config(drafter.generation_config, policy)
    drafter.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_assistant_files(folder, policy, cost_model)
    return folder


def write_assistant_files(folder, policy: AdaptiveWindowPolicy, cost_model: CostModel | None = None) -> Path:
    """Write everything ``save_assistant`` writes except the weights, config and tokenizer; returns the folder.

    ``ppow_window_policy.json``, ``ppow_cost_model.json`` (if ``cost_model``), ``custom_generate/generate.py``
    and, when the folder holds a model (``generation_config.json`` or ``config.json``), its
    ``generation_config.json`` updated by ``configure_generation_config``. An adapter-only folder (PEFT) gets
    no generation config: it is not read from there (see the module docstring; merge first).
    """
    policy = _check_policy(policy)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(folder)
    if cost_model is not None:
        cost_model.save_pretrained(folder)
    hook = folder / CUSTOM_GENERATE_FILE
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(GENERATE_PY)
    _update_generation_config(folder, policy)
    _write_modeling_file(folder)
    return folder


MODELING_FILE = "modeling_ppow_drafter.py"
_REGISTRATION_PREFIXES = ("AutoConfig.register(", "AutoModelForCausalLM.register(")


def _write_modeling_file(folder: Path) -> None:
    """For a ``PPOWDrafterForCausalLM`` folder: ``modeling_ppow_drafter.py`` + ``auto_map`` (module docstring).

    The copy drops ``drafter.py``'s Auto-class registration: loaded as remote code, it must not replace the
    classes ppow_trl registers (transformers registers the remote classes for their config class itself).
    """
    config_path = folder / "config.json"
    if not config_path.is_file():
        return
    config = json.loads(config_path.read_text())
    from .drafter import PPOWDrafterConfig

    if config.get("model_type") != PPOWDrafterConfig.model_type:
        return
    from . import drafter as drafter_module

    lines = Path(drafter_module.__file__).read_text().splitlines(keepends=True)
    kept = [
        f"# ({line.strip()} removed by ppow_trl.assisted: remote code must not re-register the model type)\n"
        if line.startswith(_REGISTRATION_PREFIXES)
        else line
        for line in lines
    ]
    header = (
        "# Copied from ppow_trl/drafter.py by ppow_trl.assisted.save_assistant, so that\n"
        "# AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True) works without ppow_trl.\n"
        "# Where ppow_trl is imported first, transformers uses ppow_trl's own classes instead.\n"
    )
    (folder / MODELING_FILE).write_text(header + "".join(kept))
    module = Path(MODELING_FILE).stem
    config["auto_map"] = {
        **config.get("auto_map", {}),
        "AutoConfig": f"{module}.PPOWDrafterConfig",
        "AutoModelForCausalLM": f"{module}.PPOWDrafterForCausalLM",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _update_generation_config(folder: Path, policy: AdaptiveWindowPolicy) -> None:
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        config = GenerationConfig.from_pretrained(folder)
    elif (folder / "config.json").is_file():
        # What transformers itself falls back to when a model folder has no generation config.
        config = GenerationConfig.from_pretrained(folder, config_file_name="config.json", _from_model_config=True)
    else:
        return
    configure_generation_config(config, policy).save_pretrained(folder)


def load_assistant(folder, **from_pretrained_kwargs):
    """Load a drafter saved by ``save_assistant`` (or ``PPOWTrainer`` + merge) with its window rule installed.

    ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **from_pretrained_kwargs)``
    (``import ppow_trl`` is done, so ``PPOWDrafterForCausalLM`` folders resolve), then makes sure that the
    generation config carries the folder's policy and that ``generate`` is the folder's hook (transformers
    skips the hook when ``generation_config=`` is passed). Pass the result as
    ``target.generate(..., assistant_model=drafter)``.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: load_assistant takes a folder written by save_assistant.")
    if not (folder / WINDOW_POLICY_FILE).is_file():
        raise FileNotFoundError(
            f"No {WINDOW_POLICY_FILE} in {folder}: this drafter was not saved by ppow_trl.assisted.save_assistant "
            "(or PPOWTrainer), so it carries no window policy. Save it with "
            "save_assistant(drafter, folder, policy=AdaptiveWindowPolicy(max_window=K, threshold=h))."
        )
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise ValueError(f"{folder} holds a PEFT adapter. " + _PEFT_MESSAGE)
    if from_pretrained_kwargs.pop("trust_remote_code", True) is not True:
        raise ValueError(
            "load_assistant needs trust_remote_code=True: the window rule is the folder's custom_generate/generate.py."
        )
    policy = AdaptiveWindowPolicy.from_pretrained(folder)
    drafter = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **from_pretrained_kwargs)
    configure_generation_config(drafter.generation_config, policy)
    if not isinstance(drafter.__dict__.get("generate"), functools.partial):
        # transformers skipped the folder's hook (generation_config= was passed, or a folder written before
        # custom_generate existed): install the same code in memory.
        drafter.generate = functools.partial(_hook()["generate"], model=drafter)
    return drafter


def _maybe_cost_model(folder: Path) -> CostModel | None:
    return CostModel.from_pretrained(folder) if (folder / COST_MODEL_FILE).is_file() else None


def load_cost_model(folder) -> CostModel | None:
    """The cost model saved with a drafter (``ppow_cost_model.json``), or ``None`` if none was saved."""
    return _maybe_cost_model(Path(folder))


__all__ = [
    "CUSTOM_GENERATE_FILE",
    "GENERATION_CONFIG_KEY",
    "MODELING_FILE",
    "attach_window_policy",
    "configure_generation_config",
    "load_assistant",
    "load_cost_model",
    "save_assistant",
    "write_assistant_files",
]

