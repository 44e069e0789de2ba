"""PPOW drafters in Hugging Face's own assisted generation: ``target.generate(..., assistant_model=drafter)``.

Route (transformers 5.24, checked in its ``generation/candidate_generator.py`` and ``generation/utils.py``):

- HF's assisted loop (``_assisted_decoding`` + ``AssistedCandidateGenerator``) reads its window settings
  from the *drafter's* ``generation_config`` (``num_assistant_tokens``, ``num_assistant_tokens_schedule``,
  ``assistant_confidence_threshold``, default 0.4), never from arguments to ``target.generate``, and has no
  ``candidate_generator=`` argument. Every round it calls ``drafter.generate(input_ids=...,
  max_new_tokens=min(num_assistant_tokens, room left), generation_config=<copy of the target's config with
  is_assistant=True, output_scores=True, return_dict_in_generate=True>, logits_processor=<the target's>,
  cache=..., attention_mask=...)`` and uses the returned ``scores`` as the drafter distributions ``q``.
- Replacing the drafter's ``generate`` by ``functools.partial(generate, model=drafter)`` is HF's documented
  hook: ``from_pretrained(folder, trust_remote_code=True)`` does it with a folder's ``custom_generate/generate.py``.

So a drafter folder gets a generation config set for HF (``configure_generation_config``:
``num_assistant_tokens = K``, schedule ``"constant"`` so HF never changes K, ``assistant_confidence_threshold = 0``:
HF's per-token rule and its ROC-based re-tuning are off, and the policy under ``ppow_window_policy``), and
the hook is ``ppow_trl/core/custom_generate/generate.py``, a module of this package that ``save_assistant`` copies
verbatim into the folder. Its ``generate`` adds, only when HF calls it as an assistant, a stopping criterion
implementing our running-product rule (``AdaptiveWindowPolicy``): after the ``i``-th drafted token, stop unless
``prod_{j<=i} conf_j >= h`` and ``i < K``, ``conf_j = max_v softmax(z_j / T_c)`` of the drafter's raw logits at
the policy's confidence temperature (the module's docstring says how it recovers ``z`` from the processed
scores HF hands a stopping criterion, and what top-k / top-p do to the confidences). The rule only decides
*how many* tokens are proposed; HF verifies them as usual, so the output stays lossless (greedy: the target's
own greedy text; sampling: the target's distribution) whatever the window lengths.

Why this route: it is HF's documented hook, works for any drafter class (plain causal LMs and
``PPOWDrafterForCausalLM`` alike) without subclassing, keeps HF's candidate generator, caches and
verification untouched, and the folder carries its policy (``ppow_window_policy.json``, also copied into
``generation_config.json``) and cost model (``ppow_cost_model.json``). ``target.generate(custom_generate=...)``
would not do: it replaces the whole decoding loop and does not forward ``assistant_model``.

What the user writes:

- With ppow_trl installed, **no remote code** (the default)::

      from ppow_trl.serving.assisted import load_assistant
      drafter = load_assistant("my-drafter")                          # a folder, or
      drafter = load_assistant("you/ppow-drafter", revision="<commit>")  # a Hub repo id
      out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=256)

  ``load_assistant`` loads the weights with ``AutoModelForCausalLM.from_pretrained`` (``import ppow_trl``
  registers ``PPOWDrafterForCausalLM``), reads the policy with ``AdaptiveWindowPolicy.from_pretrained`` and
  installs ppow_trl's own copy of the hook in memory (``attach_window_policy``). Nothing from the folder is
  executed. ``attach_window_policy(drafter, policy)`` does the same for a drafter already in memory.

- Without ppow_trl, opting into remote code::

      drafter = AutoModelForCausalLM.from_pretrained("you/ppow-drafter", trust_remote_code=True, revision="<commit>")

  Then transformers executes two files of the repo, at the revision it fetched:

  * ``custom_generate/generate.py`` (always): a byte-identical copy of ``ppow_trl/core/custom_generate/generate.py``
    of the ppow_trl version that saved it. On import it imports copy, json, os, torch and transformers'
    stopping criteria and defines functions; each ``generate`` call may read ``ppow_window_policy.json`` next
    to the weights, copies the generation config, appends the stopping criterion and calls the model class's
    own ``generate``. No network, no file writes, no subprocess.
  * ``modeling_ppow_drafter.py`` (reduced-vocabulary drafters only, through ``auto_map`` in ``config.json``):
    a copy of ``ppow_trl/drafter.py`` with its two Auto-class registration lines commented out. On import it
    imports torch, huggingface_hub's ``strict`` dataclass decorator and transformers, and defines
    ``PPOWDrafterConfig`` and ``PPOWDrafterForCausalLM`` (the target architecture's body, built with
    ``AutoModel.from_config``, plus a head over the draft vocabulary scattered into full-width logits).
    Where ppow_trl is imported first, transformers prefers ppow_trl's registered classes (a non-transformers
    local registration beats ``auto_map``: ``explicit_local_code`` in ``auto_factory.py``) and this file is
    not used for the model.

  Remote code runs with your privileges, and a repo's files can change after you read them: pass
  ``revision=`` (a commit hash you reviewed) with ``trust_remote_code=True``. ``load_assistant(...,
  trust_remote_code=True)`` does the same as this call, then sets the policy and, if transformers skipped the
  folder's hook (``generation_config=`` was passed, or an old folder has no ``custom_generate/``), installs
  ppow_trl's.

- Without ``trust_remote_code`` and without ppow_trl, HF ignores ``custom_generate/`` and drafts a fixed
  ``K`` tokens (``num_assistant_tokens``), not our adaptive rule.

Other notes:

- Batch size 1 only (HF's assisted decoding refuses larger batches).
- HF also ends a window at EOS (the target's EOS; the drafter's own when the target has none), and caps it at
  the room left before ``max_new_tokens`` (``ppow_trl.serving.generation`` uses the same cap). Any other stopping
  criterion the user passes to ``target.generate`` applies to the target only.
- A PEFT adapter folder (what ``PPOWTrainer`` writes when it trains a LoRA) holds the policy, cost model and
  ``custom_generate`` files, but HF loads an adapter through its base model's folder, so the hook and the
  window settings only apply after merging: ``save_assistant(peft_model.merge_and_unload(), folder, ...)``.
  The policy and cost model of an adapter folder or repo load with ``AdaptiveWindowPolicy.from_pretrained`` /
  ``CostModel.from_pretrained`` (a folder or a Hub id, ``revision=`` passed on).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .. import drafter as drafter_module
from ..core.cost import CostModel
from ..core.custom_generate import generate as _custom_generate_module
from ..drafting import HUB_KWARGS, detect_family, family_of
from ..utils import PEFT_ASSISTANT_MESSAGE, _looks_like_repo_id, is_peft_model, load_json
# attach_window_policy, policy_dict and configure_generation_config are public here too
from ..core.windowing import (  # noqa: F401
    GENERATION_CONFIG_KEY,
    WINDOW_POLICY_FILE,
    AdaptiveWindowPolicy,
    _check_policy,
    attach_window_policy,
    configure_generation_config,
    policy_dict,
)

CUSTOM_GENERATE_FILE = "custom_generate/generate.py"
HOOK_SOURCE = Path(_custom_generate_module.__file__)
"""``ppow_trl/core/custom_generate/generate.py``: the file ``write_assistant_files`` copies into drafter folders."""



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
    if is_peft_model(drafter):
        raise ValueError(PEFT_ASSISTANT_MESSAGE)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(f"cost_model must be a CostModel or None, got {type(cost_model).__name__}.")
    folder = Path(folder)
    family = family_of(drafter)
    vocab_size = None if tokenizer is None else len(tokenizer)
    if family.writes_hook_file:
        configure_generation_config(drafter.generation_config, policy, vocab_size)
    # A family with its own native route (DFlash: transformers' layout) gets no hook file: its window is installed
    # by load_assistant(target=) through the family's attach.
    drafter.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    write_assistant_files(folder, policy, cost_model, vocab_size, hook=family.writes_hook_file)
    return folder


def write_assistant_files(folder, policy: AdaptiveWindowPolicy, cost_model: CostModel | None = None,
                          vocab_size: int | None = None, *, hook: bool = True) -> Path:
    """Write everything ``save_assistant`` writes except the weights, config and tokenizer; returns the folder.

    ``ppow_window_policy.json``, ``ppow_cost_model.json`` (if ``cost_model``), ``custom_generate/generate.py``
    (a byte-identical copy of ``ppow_trl/core/custom_generate/generate.py``) and, when the folder holds a model
    (``generation_config.json`` or ``config.json``), its ``generation_config.json`` updated by
    ``configure_generation_config``. An adapter-only folder (PEFT) gets no generation config: it is not read
    from there (see the module docstring; merge first). ``hook=False`` (a family with a native route of its own,
    ``DrafterFamily.writes_hook_file``): no ``custom_generate/`` file.
    """
    policy = _check_policy(policy)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(folder)
    if cost_model is not None:
        cost_model.save_pretrained(folder)
    if hook:
        path = folder / CUSTOM_GENERATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HOOK_SOURCE, path)
    _update_generation_config(folder, policy, vocab_size)
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
    if config.get("model_type") != drafter_module.PPOWDrafterConfig.model_type:
        return
    lines = Path(drafter_module.__file__).read_text().splitlines(keepends=True)
    kept = [
        f"# ({line.strip()} removed by ppow_trl.serving.assisted: remote code must not re-register the model type)\n"
        if line.startswith(_REGISTRATION_PREFIXES)
        else line
        for line in lines
    ]
    header = (
        "# Copied from ppow_trl/drafter.py by ppow_trl.serving.assisted.save_assistant, so that\n"
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


def _update_generation_config(folder: Path, policy: AdaptiveWindowPolicy, vocab_size: int | None = None) -> None:
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        config = GenerationConfig.from_pretrained(folder)
    elif (folder / "config.json").is_file():
        # What transformers itself falls back to when a model folder has no generation config.
        config = GenerationConfig.from_pretrained(folder, config_file_name="config.json", _from_model_config=True)
    else:
        return
    configure_generation_config(config, policy, vocab_size).save_pretrained(folder)


def load_assistant(folder_or_repo, *, trust_remote_code: bool = False, target=None, **from_pretrained_kwargs):
    """Load a drafter saved by ``save_assistant`` (or ``PPOWTrainer`` + merge) with its window rule installed.

    ``folder_or_repo`` is a local folder or a Hub repo id. ``from_pretrained_kwargs`` go to
    ``AutoModelForCausalLM.from_pretrained`` (``torch_dtype=``, ``device_map=``...); ``revision=``, ``token=``,
    ``cache_dir=``, ``local_files_only=`` and ``force_download=`` are also used to fetch
    ``ppow_window_policy.json`` (``AdaptiveWindowPolicy.from_pretrained``). Pin ``revision=`` to a commit for
    a Hub repo.

    - ``trust_remote_code=False`` (default): nothing from the folder is executed. The weights load with
      ``AutoModelForCausalLM.from_pretrained`` (``import ppow_trl`` is done, so ``PPOWDrafterForCausalLM``
      folders resolve to ppow_trl's class) and ``attach_window_policy`` installs ppow_trl's own hook.
    - ``trust_remote_code=True``: ``from_pretrained(..., trust_remote_code=True)`` runs the folder's
      ``custom_generate/generate.py`` (and, without ppow_trl's classes, ``modeling_ppow_drafter.py``; the module
      docstring lists what they execute); the generation config then gets the folder's policy, and if
      transformers skipped the folder's hook (``generation_config=`` passed, or a folder without
      ``custom_generate/``) ppow_trl's is installed.

    Pass the result as ``target.generate(..., assistant_model=drafter)``. A drafter that reads the target's
    hidden states (EAGLE-3, ``ppow_trl.drafters.eagle3``) needs ``target=``: hooks on the target hand it the features
    (``ppow_trl.drafters.eagle3.attach_to_target``; no remote code on that route). A DFlash block drafter
    (``ppow_trl.drafters.dflash``) needs ``target=`` too and is called with ``speculation_type="dflash"``; its window rule is
    a hook on the drafter (``ppow_trl.drafters.dflash.assisted``).
    """

    hub_kwargs = {name: from_pretrained_kwargs[name] for name in HUB_KWARGS if name in from_pretrained_kwargs}
    folder = Path(folder_or_repo)
    local = folder.is_dir()
    if not local and not _looks_like_repo_id(folder_or_repo):
        raise FileNotFoundError(
            f"{folder_or_repo} is not a folder (nor a Hub repo id): load_assistant takes a folder written by "
            "save_assistant or the id of a Hub repo holding one."
        )
    if local and (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        raise ValueError(f"{folder} holds a PEFT adapter. " + PEFT_ASSISTANT_MESSAGE)
    try:
        policy = AdaptiveWindowPolicy.from_pretrained(folder_or_repo, **hub_kwargs)
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"No {WINDOW_POLICY_FILE} in {folder_or_repo}: this drafter was not saved by "
            "ppow_trl.serving.assisted.save_assistant (or PPOWTrainer), so it carries no window policy. Save it with "
            "save_assistant(drafter, folder, policy=AdaptiveWindowPolicy(max_window=K, threshold=h))."
        ) from error
    source = str(folder) if local else str(folder_or_repo)
    try:
        family, _ = detect_family(source, **hub_kwargs)  # a local folder or a Hub id, every registered layout
    except ValueError:
        if _has_file(source, "adapter_config.json", hub_kwargs):  # an adapter repo (what PPOWTrainer pushes)
            raise ValueError(f"{folder_or_repo} holds a PEFT adapter. " + PEFT_ASSISTANT_MESSAGE) from None
        raise
    if family.reads_target and target is None:  # refused before any weight is loaded
        raise ValueError(f"{folder_or_repo} holds a {family.description}: pass load_assistant(folder, "
                         "target=target) so it can read the target.")
    drafter = family.load(source, target=target, trust_remote_code=trust_remote_code, **from_pretrained_kwargs)
    return family.attach(drafter, target, policy, _saved_vocab_size(source, hub_kwargs))


def _has_file(source: str, filename: str, hub_kwargs: dict) -> bool:
    """Whether a folder or Hub repo holds ``filename``."""
    try:
        load_json(source, filename, "", **hub_kwargs)
    except (FileNotFoundError, OSError, ValueError):
        return False
    return True


def _saved_vocab_size(source: str, hub_kwargs: dict) -> int | None:
    """The ``vocab_size`` save_assistant recorded in the folder's ``generation_config.json``, read as JSON:
    transformers drops custom fields when the generation config was derived from the model config."""
    try:
        config = load_json(source, "generation_config.json", "no generation config saved.", **hub_kwargs)
    except FileNotFoundError:
        return None
    return (config.get(GENERATION_CONFIG_KEY) or {}).get("vocab_size")


def load_cost_model(folder_or_repo, **hub_kwargs) -> CostModel | None:
    """The cost model saved with a drafter (``ppow_cost_model.json``), or ``None`` if none was saved.

    ``folder_or_repo``: a local folder or a Hub repo id (``hub_kwargs`` such as ``revision=`` go to
    ``hf_hub_download``)."""
    try:
        return CostModel.from_pretrained(folder_or_repo, **hub_kwargs)
    except FileNotFoundError:
        return None


__all__ = [
    "CUSTOM_GENERATE_FILE",
    "GENERATION_CONFIG_KEY",
    "HOOK_SOURCE",
    "MODELING_FILE",
    "attach_window_policy",
    "configure_generation_config",
    "load_assistant",
    "load_cost_model",
    "policy_dict",
    "save_assistant",
    "write_assistant_files",
]
