"""The one place where ppow_trl depends on TRL internals (and on private parts of transformers' ``Trainer``).

``PPOWTrainer`` subclasses TRL's ``GRPOTrainer`` and ``KDTrainer`` subclasses transformers' ``Trainer``; both
override private methods, read private attributes and import private helpers, none of which TRL promises to keep.
Everything of that kind is listed here, as data, with the reason ppow_trl needs it, so that

- the rest of the package imports TRL's private helpers from this module only (``split_tensor_dict``,
  ``unwrap_model_for_generation``, ``ChunkedLogProbFunction`` / ``chunked_logprobs``, ``CHUNKED_LOGPROB_CHUNK_SIZE``);
- ``check_trl_contracts()`` (and ``tests/test_trl_compat.py``, one test per entry) says precisely what changed
  after a TRL upgrade: a missing name, a changed signature, a changed behaviour ppow_trl copies.

Supported: trl>=1.16,<1.17 (setup.cfg; ``ppow_trl._compat`` refuses other versions at import unless
``PPOW_TRL_SKIP_TRL_CHECK=1``, which is how to run ``check_trl_contracts()`` against another TRL).

This is the bottom layer: importing it imports neither trl nor torch (the re-exports load on first access), and it
imports nothing from ppow_trl but ``_compat``. When you add a use of a TRL internal anywhere in ppow_trl, add it to
the tables below.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re

from .._compat import SUPPORTED_TRL_RANGE, installed_trl_version

__all__ = [
    "CALLED_METHODS",
    "CHUNKED_LOGPROB_CHUNK_SIZE",
    "ChunkedLogProbFunction",
    "GRPO_CONFIG_FIELDS",
    "IMPORTED_NAMES",
    "OVERRIDDEN_METHODS",
    "PRIVATE_ATTRIBUTES",
    "SOURCE_CONTRACTS",
    "check_touch_point",
    "check_trl_contracts",
    "chunked_logprobs",
    "split_tensor_dict",
    "touch_points",
    "unwrap_model_for_generation",
]

# ---------------------------------------------------------------------------------------------------------------
# Re-exports (loaded on first access: `from ppow_trl.training._trl_compat import split_tensor_dict` works as usual)
# ---------------------------------------------------------------------------------------------------------------

_REEXPORTS = {
    # name in ppow_trl -> where TRL 1.16 defines it
    "split_tensor_dict": "trl.trainer.utils.split_tensor_dict",
    "unwrap_model_for_generation": "trl.models.utils.unwrap_model_for_generation",
    "ChunkedLogProbFunction": "trl.kernels.ChunkedLogProbFunction",
    "CHUNKED_LOGPROB_CHUNK_SIZE": "trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE",
}


def __getattr__(name: str):
    if name in _REEXPORTS:
        value = _resolve(_REEXPORTS[name])
        globals()[name] = value  # resolved once: later lookups find the module attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _reexport(name: str):
    return globals()[name] if name in globals() else __getattr__(name)


def chunked_logprobs(hidden, weight, bias, labels, temperature, softcap=None, scale=1.0, outputs=("log_probs",)):
    """``log softmax(softcap(scale * (hidden @ weight.T + bias)) / temperature)[labels]`` without the ``(N, V)`` logits.

    TRL's chunked kernel (``ChunkedLogProbFunction.apply``, positional only, 9 arguments in TRL 1.16's order:
    hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)`` or None, labels ``(N,)``, temperature, chunk size,
    final-logit softcapping or None, logit scale, outputs). ``outputs`` names the optional fields wanted among
    ``"entropy"``, ``"log_sum_sq_probs"``, ``"mean_logits"``, ``"is_top1"`` (log-probs are always computed).
    Returns TRL's tuple ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, ``None`` for fields not
    requested; differentiable in ``hidden``, ``weight`` and ``bias``.
    """
    function = _reexport("ChunkedLogProbFunction")
    chunk_size = _reexport("CHUNKED_LOGPROB_CHUNK_SIZE")
    return function.apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, scale, outputs)


# ---------------------------------------------------------------------------------------------------------------
# The touch points, as data
# ---------------------------------------------------------------------------------------------------------------

# Private (or unexported) names imported from trl -> parameter names of TRL 1.16's signature (None: a constant).
IMPORTED_NAMES: dict[str, tuple[str, ...] | None] = {
    # ppow_trainer.py, PPOWTrainer._prepare_inputs: splits the generation batch into micro-batches, as TRL does.
    "trl.trainer.utils.split_tensor_dict": ("tensor_dict", "num_chunks"),
    # ppow_trainer.py (rollout, calibration, evaluation, cost model, selection scoring): the drafter unwrapped from
    # DDP/DeepSpeed for no-grad drafting; gradient_checkpointing_kwargs is passed by keyword.
    "trl.models.utils.unwrap_model_for_generation": (
        "model", "accelerator", "gather_deepspeed3_params", "generation_kwargs", "gradient_checkpointing_kwargs",
    ),
    # window_logprobs.py: the head of the shared-context loss path, called positionally (see chunked_logprobs).
    "trl.kernels.ChunkedLogProbFunction.forward": (
        "ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
        "logit_scale", "outputs",
    ),
    # window_logprobs.py: the vocabulary tile of that kernel, the one TRL's fused head uses.
    "trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE": None,
}

# Methods ppow_trl overrides ("Class.method"; the class whose attribute super() reaches) -> TRL 1.16's (or
# transformers') parameter names. GRPOTrainer entries are PPOWTrainer's overrides, Trainer entries KDTrainer's.
OVERRIDDEN_METHODS: dict[str, tuple[str, ...]] = {
    # selects the contexts before TRL's rollout/reward/advantage code, then writes per-position advantages
    "GRPOTrainer._generate_and_score_completions": ("self", "inputs"),
    # TRL's buffering copied, shuffled group by group (the G windows of a context share a micro-batch)
    "GRPOTrainer._prepare_inputs": ("self", "generation_batch"),
    # the shared-context loss path; TRL's generic path (called with the same keywords) as the fallback
    "GRPOTrainer._get_per_token_logps_and_entropies": (
        "self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
        "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
        "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
    ),
    # writes the window policy, cost model and custom_generate/ next to the saved drafter
    "GRPOTrainer._save": ("self", "output_dir", "state_dict"),
    # saves the context selector's state in each checkpoint folder
    "GRPOTrainer._save_checkpoint": ("self", "model", "trial"),
    # restores the context selector (and the measured cost model) on resume
    "GRPOTrainer._load_optimizer_and_scheduler": ("self", "checkpoint"),
    # public, but called by TRL's _save_checkpoint with model_name=: PPOW's model card
    "GRPOTrainer.create_model_card": ("self", "model_name", "dataset_name", "tags"),
    # public: exact-resume checks, then calibration of the window rule; forwards the keywords to super()
    "GRPOTrainer.train": ("self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"),
    # public: held-out tau / acceptance instead of a loss
    "GRPOTrainer.evaluate": ("self", "eval_dataset", "ignore_keys", "metric_key_prefix"),
    # KDTrainer: the collator, not the model, reads the dataset, so its columns must survive remove_unused_columns
    "Trainer._set_signature_columns_if_needed": ("self",),
    # KDTrainer (public): the KD loss, token-weighted with num_items_in_batch like transformers' own loss
    "Trainer.compute_loss": ("self", "model", "inputs", "return_outputs", "num_items_in_batch"),
    # KDTrainer: the evaluated dataset gets the length column that group_by_length batching reads
    "Trainer.get_eval_dataloader": ("self", "eval_dataset"),
    # KDTrainer (public): adds its averaged kd/* metrics to each log
    "Trainer.log": ("self", "logs", "start_time"),
    # KDTrainer (public): eval_loss where the rows carry the teacher's top-k, plus eval_tau (KDConfig.eval_tau_window)
    "Trainer.evaluation_loop": ("self", "dataloader", "description", "prediction_loss_only", "ignore_keys",
                                "metric_key_prefix"),
}

# Private methods ppow_trl calls without overriding them -> parameter names.
CALLED_METHODS: dict[str, tuple[str, ...]] = {
    # PPOWTrainer._log_window_metrics: ppow/* metrics through TRL's buffer (reduced across processes, logged)
    "GRPOTrainer._log_metric": ("self", "name", "value"),
    # PPOWTrainer._save_checkpoint: the checkpoint folder the selector state goes into
    "Trainer._get_output_dir": ("self", "trial"),
    # KDTrainer.compute_loss: rescales the token-weighted loss like transformers does
    "Trainer.get_tp_size": ("self",),
}

# Attributes of the trainer instance (or class) that ppow_trl reads or writes and TRL/transformers define.
PRIVATE_ATTRIBUTES: dict[str, str] = {
    "GRPOTrainer._step": "read: micro-batches done, for the generation round (_generation_round) and the buffer slot",
    "GRPOTrainer._buffered_inputs": "read/written: the split generation batch of PPOWTrainer._prepare_inputs",
    "GRPOTrainer.rollout_func": "written: PPOWTrainer._rollout replaces generation (set after __init__, no warning)",
    "GRPOTrainer.num_generations": "read: G, the windows drafted per context",
    "GRPOTrainer.num_generations_eval": "read: G of evaluation rollouts (PPOWTrainer._rollout)",
    "GRPOTrainer.num_iterations": "read: a round feeds steps_per_generation x num_iterations micro-batches",
    "GRPOTrainer.temperature": "read: the temperature of the shared-context loss path",
    "GRPOTrainer._tokenizer": "read: the pad id (TRL unwraps a processor to its tokenizer)",
    "GRPOTrainer._tag_names": "overridden class attribute: the Hub tags TRL adds to the model and its card",
    "GRPOTrainer._name": "overridden class attribute: the trainer name TRL writes in the model card",
    "Trainer._signature_columns": "read/written: KDTrainer keeps the collator's columns",
    "Trainer.model_accepts_loss_kwargs": "read: KDTrainer token-weights the loss only when transformers expects it",
    "Trainer.model_wrapped": "read: the DDP/DeepSpeed-wrapped drafter handed to unwrap_model_for_generation",
    "Trainer.is_fsdp_enabled": "read: PPOWTrainer refuses FSDP (main-process calibration would deadlock)",
    "Trainer.label_names": "read/written: KDTrainer's drafters may have no labels argument",
    "Trainer.hub_model_id": "read: the model card's Hub id",
}

# GRPOConfig fields PPOWConfig reads, sets or gives a new default (a renamed field would silently become a new,
# unused PPOWConfig field).
GRPO_CONFIG_FIELDS: dict[str, str] = {
    "steps_per_generation": "micro-batches per generation round (buffer split, exact-resume check)",
    "num_generations": "G; each process drafts whole groups",
    "num_iterations": "rounds are reused num_iterations times (_generation_round)",
    "max_completion_length": "set to max_window in PPOWConfig.__post_init__",
    "reward_weights": "set to [1, proximity_weight]: R = R_speed + lambda R_prox",
    "multi_objective_aggregation": "must be 'sum_then_normalize' (PPOW's reward is the plain sum)",
    "scale_rewards": "per-position advantages are scaled like TRL's",
    "mask_truncated_completions": "default False: windows never end in EOS",
    "remove_unused_columns": "default False: rows carry the candidate index",
    "activation_checkpointing": "default False; checkpointing drops the KV cache of the shared-context path",
    "cast_lm_head_to_fp32": "passed to the shared-context loss path",
    "disable_dropout": "default True: the sampled q must be the distribution trained on",
    "use_vllm": "rejected: the rollout drafts windows itself",
    "beta": "beta > 0 needs PEFT (TRL would reload the reference from config._name_or_path)",
    "temperature": "the drafter's sampling temperature",
    "top_p": "must be 1.0 (speculative sampling needs plain softmax(logits / T))",
    "top_k": "must be 0/None (same reason)",
    "min_p": "must be None (same reason)",
    "repetition_penalty": "must be 1.0 (same reason)",
}

# Behaviours of TRL 1.16 that ppow_trl's overrides copy or rely on, each checked by a line of TRL's source
# ("Class.method", snippet, why). Whitespace is normalised before comparing.
SOURCE_CONTRACTS: list[tuple[str, str, str]] = [
    ("GRPOTrainer._generate", "self.rollout_func(prompts, self)",
     "rollout_func is called as (prompts, trainer): PPOWTrainer._rollout's signature"),
    ("GRPOTrainer._generate", 'required_keys = {"prompt_ids", "completion_ids", "logprobs"}',
     "PPOWTrainer._rollout returns these keys; the others are extra fields for the reward functions"),
    ("GRPOTrainer._generate_and_score_completions", "inp[key] = values[i]",
     "rollout extra fields (ppow_speed, ppow_proximity, ppow_credit) are merged into the input rows"),
    ("GRPOTrainer._generate_and_score_completions", '"advantages": advantages',
     "PPOWTrainer._generate_and_score_completions rewrites output['advantages'] per position"),
    ("GRPOTrainer._generate_and_score_completions", '"completion_mask": completion_mask',
     "PPOWTrainer._generate_and_score_completions reads output['completion_mask']"),
    ("GRPOTrainer._prepare_inputs", "self._buffered_inputs[self._step % self.args.steps_per_generation]",
     "PPOWTrainer._prepare_inputs copies TRL's buffering (regenerate every steps_per_generation x num_iterations)"),
    ("GRPOTrainer.training_step", "self._step += 1",
     "_step counts micro-batches (PPOWTrainer._generation_round)"),
    ("GRPOTrainer._get_per_token_logps_and_entropies", "fused_lm_head=True",
     "the drafter's patched forward intercepts TRL's fused_lm_head=/labels= call (reduced-vocabulary labels)"),
    ("GRPOTrainer._save_checkpoint", "self.create_model_card(model_name=model_name)",
     "PPOWTrainer.create_model_card must accept model_name="),
]

_OWNERS = {"GRPOTrainer": "trl.GRPOTrainer", "GRPOConfig": "trl.GRPOConfig", "Trainer": "transformers.Trainer"}

# ---------------------------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------------------------


def touch_points() -> list[str]:
    """Every entry of the tables, as the keys ``check_touch_point`` takes."""
    return [
        *IMPORTED_NAMES, *OVERRIDDEN_METHODS, *CALLED_METHODS, *PRIVATE_ATTRIBUTES,
        *(f"GRPOConfig.{name}" for name in GRPO_CONFIG_FIELDS),
        *(_source_key(where, snippet) for where, snippet, _ in SOURCE_CONTRACTS),
    ]


def check_trl_contracts() -> list[str]:
    """Human-readable problems with the installed trl/transformers (empty when every touch point holds)."""
    return [problem for key in touch_points() for problem in check_touch_point(key)]


def check_touch_point(key: str) -> list[str]:
    """The problems of one touch point (a key of the tables, or ``touch_points()``); empty when it holds."""
    try:
        if key in IMPORTED_NAMES:
            return _check_callable(key, key, IMPORTED_NAMES[key], "ppow_trl imports it")
        if key in OVERRIDDEN_METHODS:
            return _check_callable(key, _owner_path(key), OVERRIDDEN_METHODS[key], "ppow_trl overrides it")
        if key in CALLED_METHODS:
            return _check_callable(key, _owner_path(key), CALLED_METHODS[key], "ppow_trl calls it")
        if key in PRIVATE_ATTRIBUTES:
            return _check_attribute(key, PRIVATE_ATTRIBUTES[key])
        if key.startswith("GRPOConfig.") and key.split(".", 1)[1] in GRPO_CONFIG_FIELDS:
            return _check_config_field(key.split(".", 1)[1])
        for where, snippet, why in SOURCE_CONTRACTS:
            if key == _source_key(where, snippet):
                return _check_source(where, snippet, why)
    except Exception as error:  # noqa: BLE001 - any failure to inspect is a problem to report, not a crash
        return [_message(key, f"could not be checked ({type(error).__name__}: {error})", "")]
    raise KeyError(f"{key!r} is not a touch point of ppow_trl.training._trl_compat (see touch_points()).")


def _check_callable(key, path, expected, use):
    try:
        obj = _resolve(path)
    except (ImportError, AttributeError) as error:
        return [_message(key, f"is missing ({type(error).__name__}: {error})", use)]
    if expected is None:  # a constant
        if not isinstance(obj, int) or isinstance(obj, bool) or obj <= 0:
            return [_message(key, f"is no longer a positive int (got {obj!r})", use)]
        return []
    try:
        found = tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError) as error:
        return [_message(key, f"has no inspectable signature ({error})", use)]
    if found != tuple(expected):
        return [_message(key, f"changed signature: trl 1.16 has ({', '.join(expected)}), the installed one has "
                              f"({', '.join(found)})", use)]
    return []


def _check_attribute(key, why):
    owner, name = key.split(".", 1)
    cls = _resolve(_OWNERS[owner])
    for klass in inspect.getmro(cls):
        if name in vars(klass):
            return []  # a class attribute, property or descriptor
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]+)?=(?!=)")
    for klass in inspect.getmro(cls):
        if klass.__module__.split(".")[0] in ("trl", "transformers") and pattern.search(_class_source(klass)):
            return []
    return [_message(key, f"is no longer set by {owner} or its bases (no `self.{name} = ...`)", why)]


def _check_config_field(name):
    import dataclasses

    config = _resolve(_OWNERS["GRPOConfig"])
    if name not in {field.name for field in dataclasses.fields(config)}:
        return [_message(f"GRPOConfig.{name}", "is no longer a field of GRPOConfig", GRPO_CONFIG_FIELDS[name])]
    return []


def _check_source(where, snippet, why):
    key = _source_key(where, snippet)
    try:
        obj = _resolve(_owner_path(where))
    except (ImportError, AttributeError) as error:
        return [_message(key, f"{where} is missing ({type(error).__name__}: {error})", why)]
    if _normalise(snippet) not in _normalise(inspect.getsource(obj)):
        return [_message(key, f"{where} no longer contains `{snippet}`: the behaviour ppow_trl relies on changed",
                         why)]
    return []


@functools.lru_cache(maxsize=None)
def _class_source(klass) -> str:
    try:
        return inspect.getsource(klass)
    except (OSError, TypeError):
        return ""


def _message(key: str, problem: str, why: str) -> str:
    installed = installed_trl_version()
    installed = f"trl {installed} is installed" if installed else "trl is not installed"
    if key.startswith("Trainer."):
        installed += f" (and transformers {_distribution_version('transformers')})"
    reason = f" ({why})" if why else ""
    return (f"{key} {problem}{reason}. ppow_trl supports trl{SUPPORTED_TRL_RANGE} and {installed}: "
            f'pip install "trl{SUPPORTED_TRL_RANGE}"')


def _distribution_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def _owner_path(key: str) -> str:
    owner, rest = key.split(".", 1)
    return f"{_OWNERS[owner]}.{rest}"


def _source_key(where: str, snippet: str) -> str:
    return f"{where}: {snippet}"


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _resolve(dotted: str):
    """The object at ``dotted``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name) and split > 1:
                raise  # a dependency of that module is missing, not the module itself
            if split == 1:
                raise
            continue
        for part in parts[split:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)
