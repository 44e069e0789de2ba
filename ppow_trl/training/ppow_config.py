"""Configuration of PPOWTrainer (TRL style: a GRPOConfig subclass, every field documented)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from ..models import QUANTIZATIONS
from ..core.rewards import DIVERGENCES
from ..compiled_runtime.precision import PRECISIONS
from ..serving.runtime import RUNTIMES
from ..core.windowing import SERVED_MIN_SPEEDUP


@dataclass
class PPOWConfig(GRPOConfig):
    r"""
    Configuration class for [`PPOWTrainer`]: GRPO on speculative windows, with the definitions of docs/ppow.md.

    Only PPOW's parameters are listed here; see [`~trl.GRPOConfig`] for the rest. `num_generations` is the
    number G of windows drafted per context, `temperature` the drafter's sampling temperature (the
    policy samples exactly from `softmax(logits / temperature)`, so `top_p`, `top_k`, `min_p` and
    `repetition_penalty` must keep their neutral values), and `max_completion_length` is set to `max_window`.

    Parameters:
        > Windows

        max_window (`int`, *optional*, defaults to `8`):
            K, the most tokens drafted per window.
        window_threshold (`float`, *optional*, defaults to `0.0`):
            h in [0, 1]: the drafter keeps drafting while the running acceptance estimate `prod conf_j` stays
            at or above h (0 = fixed windows of K tokens). Saved with the drafter and used by generation.
        confidence_temperature (`float`, *optional*, defaults to `1.0`):
            T_c of the window rule's confidences `conf_j = max softmax(z_j / T_c)` (z_j the drafter's logits),
            the same in rollouts, calibration and every generation route, greedy or sampled; saved in
            `ppow_window_policy.json`.

        > Window calibration (needs `eval_dataset`: held-out target-generated responses)

        calibrate_window (`bool`, *optional*, defaults to `True`):
            Choose (K, h) maximising the cost-model speedup on held-out contexts at the end of `train()` and at
            each evaluation, so `save_model` writes a rule matched to the drafter it saves. Without an
            `eval_dataset` the configured `max_window`/`window_threshold` are kept (with a warning).
        calibration_regime (`str`, *optional*, defaults to `"greedy"`):
            The decoding the saved policy is for: `"greedy"` (greedy drafting, greedy verification), `"sampling"`
            (drafting and verification at `temperature`) or `"both"` (the mean of the two speedups).
        calibration_contexts_per_response (`int`, *optional*, defaults to `4`):
            Contexts taken from each held-out response (evenly spaced prefixes).
        calibration_max_contexts (`int`, *optional*, defaults to `256`):
            At most this many held-out contexts.
        served_min_speedup (`float`, *optional*, defaults to `1.05`):
            The served rule (after training, on the serving runtime) speculates only when predicted at least this
            much faster than plain decoding; otherwise it serves K = 0
            (`ppow_trl.core.windowing.SERVED_MIN_SPEEDUP`: a margin for the prediction's error). 1.0 serves any
            rule predicted above 1x.

        > Evaluation (`eval_dataset`, `eval_strategy`/`eval_steps`)

        eval_max_new_tokens (`int`, *optional*, defaults to `64`):
            Tokens per held-out prompt for `eval_tau` (exact greedy tau of the fast loop at the calibrated policy).
        eval_num_prompts (`int`, *optional*):
            Held-out prompts used for `eval_tau` (default: all rows of `eval_dataset`).

        > Cost model and rewards

        drafter_cost (`float`, *optional*):
            t_d / t_t. With `verify_cost`, the cost model is taken as given; otherwise it is measured on this
            machine when the trainer starts (`ppow_trl.calibrate_cost_model`).
        verify_cost (`list[float]`, *optional*):
            t_v(L) / t_t for L = 0..K.
        speed_reward (`str`, *optional*, defaults to `"cost"`):
            `"cost"`: R_speed = S(y) = (E[A|y] + 1) t_t / (L t_d + t_v(L)). `"tokens"`: R_speed = E[A|y] + 1
            (the ablation without the cost term).
        proximity_weight (`float`, *optional*, defaults to `0.5`):
            lambda in R = R_speed + lambda R_prox (0 = the ablation without the proximity reward).
        proximity_divergence (`str`, *optional*, defaults to `"tv"`):
            R_prox per position: `"tv"` (1 - TV), `"kl"` (-KL(p||q)) or `"js"` (-JS).
        acceptance (`str`, *optional*, defaults to `"expected"`):
            `"expected"`: E[A|y] under speculative sampling, with the target at `verify_temperature`.
            `"greedy"`: the realised greedy accepted length A (verification against the target's argmax).
        reward_source (`str`, *optional*, defaults to `"target"`):
            Where greedy rewards come from. `"target"`: the target verifies every window (one forward per batch).
            `"cache"`: from the training text itself (`ppow_trl.training.cached_verification`), exact when the responses are
            the target's own greedy text: `A` is the leading run of matches with the response's next tokens, and the
            target runs only for windows that run past a response's end; the selection scores' `p` is read from the
            text too (drafters that read the target's hidden states still run it for their features). Needs
            `acceptance="greedy"` and `proximity_positions="reached"`.
        proximity_positions (`str`, *optional*):
            The positions R_prox averages over: `"window"` (every drafted position, docs/ppow.md) or `"reached"` (position i
            weighted by P(A >= i - 1 | y): the positions verification reaches). Default: `"reached"` with
            `reward_source="cache"`, else `"window"`.
        verify_temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the target's distributions p_i in `"expected"` mode (match the decoding
            temperature you will serve with).
        per_token_credit (`str`, *optional*, defaults to `"none"`):
            `"none"`: one advantage per window (GRPO). `"replace"`: per-position advantages instead: token k is
            credited with the reward its window gains from position k on, `C_k = (S_L - S_{k-1}) +
            lambda (1/L) sum_{j>=k} prox_j` (S_k the speedup of the window cut to k tokens, S_0 = 1; with
            `speed_reward="tokens"` the first term is the expected accepted tokens from k on), normalised at
            each position over the windows of the group that reach it. `"add"`: the window advantage plus
            those per-position advantages. `True`/`False` are read as `"add"`/`"none"`.

        > Divergence-aware window selection

        selection_beta (`float`, *optional*, defaults to `1.0`):
            Window starts are drawn with probability ~ (s_t + eps)^beta, s_t = conf_t * D(p_t, q_t); 0 = uniform.
        selection_eps (`float`, *optional*, defaults to `1e-3`):
            eps above.
        selection_uniform_share (`float`, *optional*, defaults to `0.1`):
            Share of the draws made uniformly, so every context stays reachable between refreshes.
        selection_divergence (`str`, *optional*, defaults to `"kl"`):
            D in s_t: `"kl"`, `"tv"` or `"js"`.
        selection_refresh_steps (`int`, *optional*, defaults to `50`):
            Rescore contexts with the current drafter every this many optimizer steps (also at step 0).
        selection_refresh_sequences (`int`, *optional*, defaults to `64`):
            Sequences rescored per refresh (a rotating subset; all of them if the dataset is smaller).

        > Training path

        shared_context_logprobs (`bool`, *optional*, defaults to `True`):
            Compute each context once per micro-batch in the loss's forward (its KV cache, with gradients, is
            shared by the windows drafted after it) instead of TRL's generic path, which recomputes it for each
            of the G windows. Same log-probs and gradients; normalises over the vocabulary the rollout sampled
            from (required for drafters whose head has more rows than the tokenizer).
        keep_window_distributions (`bool`, *optional*, defaults to `False`):
            Keep the full-vocabulary p and q of the latest batch in `trainer.last_window_rewards` (for
            inspection); by default only per-window terms are kept.

        > Target

        target_quantization (`str`, *optional*):
            `None`, `"4bit"` or `"8bit"` (bitsandbytes): how a target given by name is loaded.
        runtime (`str`, *optional*, defaults to `"eager"`):
            The runtime the cost model (the speed reward's, and the served rule's) is measured on and the recipe's
            evaluation serves on (`ppow_trl.serving.runtime`): `"compiled"` (inductor over a static KV cache, on CPUs;
            minutes to compile once per machine, then cached on disk; eager with a one-line message where compiling
            is not possible) or `"eager"`. The recipe's offline default sets `"compiled"`. Training always runs
            eagerly.
        row_independent (`bool`, *optional*, defaults to `True`):
            Compiled runtime: a row's logits do not depend on the rows verified with it, so speculation gives plain
            decoding's tokens bitwise (the decode step takes about 1.1x as long).
        compile_packages (`bool`, *optional*, defaults to `True`):
            Compiled runtime: keep the compiled graphs as AOTInductor packages on disk, which a later run loads in
            seconds, instead of compiling them with `torch.compile` in every run.
        serving_precision (`str`, *optional*, defaults to `"fp32"`):
            The target's precision on that runtime (`ppow_trl.compiled_runtime.precision`): `"fp32"`, `"bf16"` or
            `"int8"` (weight-only, per-row scales; fewer bytes read per token). The cost model and the served rule are
            measured on a converted copy of the target; the rewards' target probabilities stay those of the loaded
            target. Lossless means speculative = plain decoding at this precision.
        drafter_serving_precision (`str`, *optional*):
            The drafter's precision on that runtime (`"fp32"`, `"bf16"`, `"int8"`; default: as trained). The drafter
            only proposes, so its precision changes its cost per step and how often it is accepted, never the
            output; the cost model and the served rule are measured on the converted drafter. Training always uses
            the drafter as it is.
    """

    max_window: int = field(default=8, metadata={"help": "K, the most tokens drafted per window."})
    window_threshold: float = field(default=0.0, metadata={"help": "h in [0, 1]; 0 = fixed windows of K tokens."})
    confidence_temperature: float = field(default=1.0, metadata={"help": "T_c of the window rule's confidences."})
    calibrate_window: bool = field(default=True, metadata={"help": "Calibrate (K, h) on eval_dataset after training."})
    calibration_regime: str = field(default="greedy", metadata={"help": "'greedy', 'sampling' or 'both'."})
    calibration_contexts_per_response: int = field(default=4, metadata={"help": "Contexts per held-out response."})
    calibration_max_contexts: int = field(default=256, metadata={"help": "Most held-out calibration contexts."})
    served_min_speedup: float = field(default=SERVED_MIN_SPEEDUP, metadata={
        "help": "Least predicted speedup for the served rule to speculate (else K = 0); 1.0: any rule above 1x."})
    eval_max_new_tokens: int = field(default=64, metadata={"help": "Tokens per held-out prompt for eval_tau."})
    eval_num_prompts: int | None = field(default=None, metadata={"help": "Held-out prompts for eval_tau (all)."})
    shared_context_logprobs: bool = field(default=True, metadata={"help": "Compute each context once in the loss."})
    keep_window_distributions: bool = field(default=False, metadata={"help": "Keep full p and q of the last batch."})
    drafter_cost: float | None = field(default=None, metadata={"help": "t_d / t_t; measured at start-up if unset."})
    verify_cost: list[float] | None = field(default=None, metadata={"help": "t_v(L) / t_t for L = 0..K."})
    speed_reward: str = field(default="cost", metadata={"help": "'cost' (S(y)) or 'tokens' (E[A|y] + 1)."})
    proximity_weight: float = field(default=0.5, metadata={"help": "lambda in R = R_speed + lambda R_prox."})
    proximity_divergence: str = field(default="tv", metadata={"help": "'tv', 'kl' or 'js'."})
    acceptance: str = field(default="expected", metadata={"help": "'expected' (E[A|y]) or 'greedy' (A)."})
    reward_source: str = field(default="target", metadata={"help": "'target' (verify windows) or 'cache' (greedy, from the text)."})
    proximity_positions: str | None = field(default=None, metadata={"help": "'window' or 'reached' (default by reward_source)."})
    verify_temperature: float = field(default=1.0, metadata={"help": "Temperature of the target's p_i."})
    per_token_credit: str = field(default="none", metadata={"help": "'none', 'replace' or 'add' (per-position advantages)."})
    selection_beta: float = field(default=1.0, metadata={"help": "Selection strength; 0 = uniform."})
    selection_eps: float = field(default=1e-3, metadata={"help": "eps in (s + eps)^beta."})
    selection_uniform_share: float = field(default=0.1, metadata={"help": "Uniform share of the draws."})
    selection_divergence: str = field(default="kl", metadata={"help": "'kl', 'tv' or 'js'."})
    selection_refresh_steps: int = field(default=50, metadata={"help": "Rescore every N optimizer steps."})
    selection_refresh_sequences: int = field(default=64, metadata={"help": "Sequences rescored per refresh."})
    target_quantization: str | None = field(default=None, metadata={"help": "None, '4bit' or '8bit'."})
    runtime: str = field(default="eager", metadata={"help": "Serving runtime: 'compiled' or 'eager'."})
    row_independent: bool = field(default=True, metadata={"help": "Compiled runtime: a row's logits independent of "
                                                                  "the rows verified with it (speculation lossless "
                                                                  "bitwise; the decode step about 1.1x as long)."})
    compile_packages: bool = field(default=True, metadata={"help": "Compiled runtime: keep the graphs as "
                                                                   "AOTInductor packages on disk (a later run loads "
                                                                   "them in seconds) instead of torch.compile."})
    serving_precision: str = field(default="fp32", metadata={"help": "Target precision when serving: 'fp32', 'bf16' "
                                                                     "or 'int8'."})
    drafter_serving_precision: str | None = field(default=None, metadata={
        "help": "Drafter precision when serving: 'fp32', 'bf16' or 'int8' (default: as trained); never changes the output."})

    # Defaults that differ from GRPOConfig; each help says why (docs/configuration.md lists them).
    activation_checkpointing: bool | None = field(default=False, metadata={
        "help": "Activation checkpointing of the drafter; off: drafters are small, it costs time and saves little "
                "memory."})
    gradient_checkpointing: bool | None = field(default=None, metadata={
        "help": "Deprecated alias of activation_checkpointing."})
    bf16: bool | None = field(default=None, metadata={
        "help": "bf16 mixed precision; None: only when CUDA is available (on CPUs it is very slow)."})
    ignore_data_skip: bool = field(default=True, metadata={
        "help": "Must stay True: contexts and windows are drawn per generation round from seeded generators, so a "
                "resumed run continues from the restored step instead of replaying the dataloader."})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": "Must stay False: windows never end in EOS, so GRPO would mask every window as truncated."})
    remove_unused_columns: bool | None = field(default=False, metadata={
        "help": "Must stay False: the rows carry the context's candidate index next to the prompt ids."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Disable dropout in the drafter: dropout would make the sampled q differ from the distribution "
                "that training scores."})

    def compile_settings(self):
        """The compiled runtime's ``CompileSettings`` from ``row_independent`` and ``compile_packages``."""
        from ..compiled_runtime.compiled import CompileSettings

        return CompileSettings(row_independent=self.row_independent, packaged=self.compile_packages)

    def __post_init__(self):
        if isinstance(self.per_token_credit, bool) or self.per_token_credit in ("True", "False", "true", "false"):
            self.per_token_credit = "add" if str(self.per_token_credit).lower() == "true" else "none"
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            # HF would fall back to "loss", which PPOWTrainer's evaluation does not produce.
            self.metric_for_best_model = "eval_tau"
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available() and not self.fp16
        if self.proximity_positions is None:
            self.proximity_positions = "reached" if self.reward_source == "cache" else "window"
        self.max_completion_length = self.max_window if isinstance(self.max_window, int) else None
        self.validate_training_numbers()  # first: GRPOConfig's own set-up divides by some of them
        super().__post_init__()
        self.validate_ppow()

    def validate_training_numbers(self) -> None:
        """Check the inherited optimisation fields that transformers and trl accept out of range (a negative
        learning rate, no steps, no generations), so a bad value fails here and not after the data is built."""
        errors = []
        if not self.learning_rate > 0:
            errors.append(f"learning_rate must be > 0, got {self.learning_rate}: pass the optimizer's step size, "
                          "e.g. --learning_rate 1e-5.")
        if self.max_steps == 0 or self.max_steps < -1:
            errors.append(f"max_steps must be > 0 (optimizer steps) or -1 (train for num_train_epochs), got "
                          f"{self.max_steps}.")
        if self.max_steps <= 0 and not self.num_train_epochs > 0:
            errors.append(f"num_train_epochs must be > 0 when max_steps is -1, got {self.num_train_epochs}: pass "
                          "--num_train_epochs 1 or a number of optimizer steps with --max_steps.")
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be an integer >= 1, got {getattr(self, name)}.")
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            errors.append(f"steps_per_generation must be >= 1 (or unset: gradient_accumulation_steps), got "
                          f"{self.steps_per_generation}.")
        if self.num_generations is not None and self.num_generations < 2:
            errors.append(f"num_generations must be >= 2 (the windows of a group are scored against each other), got "
                          f"{self.num_generations}.")
        if self.weight_decay < 0:
            errors.append(f"weight_decay must be >= 0, got {self.weight_decay}.")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            errors.append(f"max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}.")
        if self.beta < 0:
            errors.append(f"beta (the KL coefficient) must be >= 0 (0 = no KL term), got {self.beta}.")
        if not self.epsilon > 0:
            errors.append(f"epsilon (the clipping range) must be > 0, got {self.epsilon}.")
        if errors:
            raise ValueError("Invalid PPOWConfig:\n- " + "\n- ".join(errors))

    def validate_ppow(self) -> None:
        """Check PPOW's fields; every message names the field and what to do."""
        errors = []
        if not isinstance(self.max_window, int) or self.max_window < 1:
            errors.append(f"max_window (K) must be an integer >= 1, got {self.max_window!r}.")
        if not 0.0 <= self.window_threshold <= 1.0:
            errors.append(f"window_threshold (h) must lie in [0, 1], got {self.window_threshold}.")
        if (self.drafter_cost is None) != (self.verify_cost is None):
            errors.append("Give both drafter_cost and verify_cost, or neither (then they are measured at start-up).")
        if self.verify_cost is not None and (
            len(self.verify_cost) != self.max_window + 1 or self.verify_cost[0] != 1.0
        ):
            errors.append(
                f"verify_cost must list t_v(L)/t_t for L = 0..max_window ({self.max_window + 1} values, the first "
                f"1.0), got {self.verify_cost}."
            )
        if self.reward_weights is not None and list(self.reward_weights) != [1.0, self.proximity_weight]:
            errors.append("Set proximity_weight instead of reward_weights: PPOW's reward is R_speed + lambda R_prox.")
        if self.use_vllm:
            errors.append("use_vllm is not supported: the drafter samples windows itself (its exact q is needed).")
        if self.speed_reward not in ("cost", "tokens"):
            errors.append(f"speed_reward must be 'cost' or 'tokens', got {self.speed_reward!r}.")
        if self.acceptance not in ("expected", "greedy"):
            errors.append(f"acceptance must be 'expected' or 'greedy', got {self.acceptance!r}.")
        if self.reward_source not in ("target", "cache"):
            errors.append(f"reward_source must be 'target' or 'cache', got {self.reward_source!r}.")
        if self.proximity_positions not in ("window", "reached"):
            errors.append(f"proximity_positions must be 'window' or 'reached', got {self.proximity_positions!r}.")
        if self.reward_source == "cache" and self.acceptance != "greedy":
            errors.append("reward_source='cache' needs acceptance='greedy': T = 1 rewards read the target's "
                          "distributions after drafted tokens that are not in the cached text. Use "
                          "reward_source='target' for acceptance='expected'.")
        if self.reward_source == "cache" and self.proximity_positions != "reached":
            errors.append("reward_source='cache' needs proximity_positions='reached': the cached text holds the "
                          "target's distribution only up to a window's first rejection.")
        for name in ("proximity_divergence", "selection_divergence"):
            if getattr(self, name) not in DIVERGENCES:
                errors.append(f"{name} must be one of {DIVERGENCES}, got {getattr(self, name)!r}.")
        if self.acceptance == "expected" and self.verify_temperature != self.temperature:
            errors.append(
                f"verify_temperature ({self.verify_temperature}) must equal temperature ({self.temperature}): speculative "
                "sampling verifies the drafter's samples against the target at the decoding temperature, and the "
                "drafter samples at `temperature`. Set both to the temperature you will serve with."
            )
        if getattr(self, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
            errors.append(
                f"multi_objective_aggregation must be 'sum_then_normalize', got {self.multi_objective_aggregation!r}: "
                "PPOW's reward is the plain sum R = R_speed + lambda R_prox, normalised within the group."
            )
        if self.per_token_credit not in ("none", "replace", "add"):
            errors.append(f"per_token_credit must be 'none', 'replace' or 'add', got {self.per_token_credit!r}.")
        if self.calibration_regime not in ("greedy", "sampling", "both"):
            errors.append(f"calibration_regime must be 'greedy', 'sampling' or 'both', got {self.calibration_regime!r}.")
        if not self.served_min_speedup >= 1.0:  # NaN too
            errors.append(f"served_min_speedup must be >= 1 (1.0: serve any rule predicted above 1x), got "
                          f"{self.served_min_speedup}.")
        if self.confidence_temperature <= 0:
            errors.append(f"confidence_temperature must be > 0, got {self.confidence_temperature}.")
        if self.calibration_contexts_per_response < 1 or self.calibration_max_contexts < 1 or self.eval_max_new_tokens < 1:
            errors.append("calibration_contexts_per_response, calibration_max_contexts and eval_max_new_tokens must be >= 1.")
        if self.temperature <= 0 or self.verify_temperature <= 0:
            errors.append("temperature and verify_temperature must be > 0 (use acceptance='greedy' for greedy verification).")
        if self.top_p != 1.0 or self.top_k not in (0, None) or self.min_p is not None or self.repetition_penalty != 1.0:
            errors.append(
                "top_p must be 1.0, top_k 0, min_p None and repetition_penalty 1.0: speculative sampling needs q to be "
                "the distribution the drafter really sampled from, which is softmax(logits / temperature)."
            )
        if self.selection_beta < 0 or self.selection_eps <= 0 or not 0.0 <= self.selection_uniform_share <= 1.0:
            errors.append("Need selection_beta >= 0, selection_eps > 0 and selection_uniform_share in [0, 1].")
        if self.selection_refresh_steps < 1 or self.selection_refresh_sequences < 1:
            errors.append("selection_refresh_steps and selection_refresh_sequences must be >= 1.")
        if self.runtime not in RUNTIMES:
            errors.append(f"runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}.")
        if self.serving_precision not in PRECISIONS:
            errors.append(f"serving_precision must be one of {', '.join(PRECISIONS)}, got {self.serving_precision!r}.")
        if self.drafter_serving_precision not in (None, *PRECISIONS):
            errors.append(f"drafter_serving_precision must be one of {', '.join(PRECISIONS)} (or unset), got "
                          f"{self.drafter_serving_precision!r}.")
        if self.target_quantization not in QUANTIZATIONS:
            errors.append(f"target_quantization must be one of {QUANTIZATIONS}, got {self.target_quantization!r}.")
        if not self.ignore_data_skip:
            errors.append("ignore_data_skip must stay True: the context selector restores its own position on resume.")
        if self.mask_truncated_completions:
            errors.append("mask_truncated_completions must stay False: windows never end in EOS.")
        if self.remove_unused_columns:
            errors.append("remove_unused_columns must stay False: rows carry the context's candidate index.")
        local_rows = self.per_device_train_batch_size * self.steps_per_generation
        if local_rows % self.num_generations:
            errors.append(
                f"Each process drafts whole groups: per_device_train_batch_size x steps_per_generation ({local_rows}) "
                f"must be divisible by num_generations ({self.num_generations})."
            )
        if errors:
            raise ValueError("Invalid PPOWConfig:\n- " + "\n- ".join(errors))
