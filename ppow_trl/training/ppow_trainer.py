"""PPOWTrainer: GRPO on speculative windows, with the target model as verifier.

The drafter is the policy. For each context (a prefix of a target-generated response, chosen by the
divergence-aware sampler) it samples G windows of up to K tokens under the adaptive stop rule; the
frozen target verifies each window in one forward that reuses the context's KV cache; the shared core
turns the distributions into E[A|y] (or A), S(y) and R_prox; TRL's group-relative advantages and
clipped loss do the rest. No text is decoded for rewards: everything works on token ids and
probabilities.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from pathlib import Path

import torch
from accelerate.utils import broadcast, broadcast_object_list
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer

from ._trl_compat import split_tensor_dict, unwrap_model_for_generation
from ..serving.assisted import write_assistant_files
from ..serving.calibration import calibrate_policy, held_out_contexts
from .contexts import ContextPool, ContextSelector, refresh_scores
from ..core.cost import COST_MODEL_FILE, CostModel
from ..core.credit import per_position_advantages
from ..drafter import ReducedVocabHeadMixin
from ..drafting import family_of, load_drafter
from ..features import RolloutFeatures
from .logged_metrics import PPOW_EVAL, keys
from .model_card import render_model_card, write_model_card
from ..models import check_compatibility, check_same_device, load_target
from .ppow_config import PPOWConfig
from .held_out import held_out_tau_counts, held_out_window_metrics
from ..core.rewards import divergence
from ..serving.runtime import serving_runtime
from .cached_verification import cached_next_tokens, verify_windows_from_cache
from ..core.rollout import VerifiedWindows, verify_windows, window_rewards
from .window_logprobs import install_loss_route
from ..utils import unwrap_model
from ..core.windowing import AdaptiveWindowPolicy

logger = logging.getLogger(__name__)

SELECTOR_STATE_FILE = "ppow_context_selector.pt"


# TRL needs reward functions (and names them in its logs: rewards/speed/mean, rewards/proximity/mean).
# Our rollout computes both terms from token ids and probabilities and hands them over per row.
def speed(prompts, completions, ppow_speed, **kwargs):
    """R_speed of each window, computed in the rollout (``PPOWTrainer.window_rewards``)."""
    return ppow_speed


def proximity(prompts, completions, ppow_proximity, **kwargs):
    """R_prox of each window, computed in the rollout (``PPOWTrainer.window_rewards``)."""
    return ppow_proximity


class PPOWTrainer(GRPOTrainer):
    """Trains a drafter with GRPO on window-level speculative rewards from a frozen target verifier.

    Args:
        model: the drafter (a causal LM sharing the target's tokenizer, e.g. from `ppow_trl.make_drafter`),
            or a folder / Hub id of one (any family, any layout it imports: `ppow_trl.drafting.load_drafter`).
        target_model: the target (frozen, never receives gradients), or a path / Hub id loaded with
            `args.target_quantization` (None, "4bit", "8bit").
        args: a `PPOWConfig`.
        train_dataset: target-generated responses with `prompt_ids` and `response_ids`
            (`ppow_trl.data.build_target_responses`). Every response prefix is a candidate context.
        processing_class: the target's tokenizer.
        drafter_processing_class: the drafter's tokenizer, if it has its own (checked to be identical).
        peft_config: a `peft.LoraConfig` to train a LoRA adapter (full fine-tuning when None).
        cost_model: a `CostModel`; else `args.drafter_cost`/`args.verify_cost`; else measured at start-up.
    """

    _tag_names = ["trl", "ppow", "speculative-decoding"]
    _name = "PPOW"

    def __init__(
        self,
        model,
        target_model,
        args: PPOWConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        drafter_processing_class=None,
        peft_config=None,
        callbacks=None,
        optimizers=(None, None),
        cost_model: CostModel | None = None,
    ):
        args = args or PPOWConfig("ppow-drafter")
        if not isinstance(args, PPOWConfig):
            raise TypeError(f"args must be a PPOWConfig, got {type(args).__name__}.")
        if processing_class is None:
            raise ValueError("Pass processing_class=<the target's tokenizer>: contexts and windows are its token ids.")
        if eval_dataset is not None:
            # Held-out target responses: eval_tau / eval_expected_accepted and the window calibration.
            ContextPool(eval_dataset)  # same columns and checks as the training data, failing here
        if train_dataset is None:
            raise ValueError("Pass train_dataset: target-generated responses (ppow_trl.data.build_target_responses).")
        if isinstance(target_model, str):
            target_model = load_target(target_model, quantization=args.target_quantization)
        if isinstance(model, str):  # a folder or Hub id of any family, any layout it imports
            model = load_drafter(model, target=target_model)
        self.vocab_size = check_compatibility(target_model, model, processing_class, drafter_processing_class)
        self.family = family_of(model)  # what this drafter is: its session, loss states, cost unit (ppow_trl.drafting)
        if not self.family.trainable:
            raise ValueError(f"A {self.family.name} drafter has no parameters to train: evaluate it with ppow_trl.bench.")
        self.family.prepare_for_training(model, target_model)
        room = min(_max_positions(target_model), _max_positions(model)) - (args.max_window + 1)
        self.context_pool = ContextPool(train_dataset, max_context_length=room)

        # Frozen verifier: eval mode, no gradients, never wrapped or prepared by accelerate.
        self.target = target_model.eval().requires_grad_(False)
        args.reward_weights = [1.0, args.proximity_weight]
        if args.beta > 0 and peft_config is None:
            # Without PEFT, TRL builds the reference model by reloading `config._name_or_path`, which for a drafter
            # built in memory (a truncated target, a KD warm start) is not this drafter at all.
            raise ValueError(
                "beta > 0 needs a peft_config: the KL reference is then exactly the initial drafter (the adapter "
                "disabled). Without PEFT, TRL would reload the reference from config._name_or_path, which is not the "
                "drafter you pass. Or set beta=0 (the default)."
            )
        super().__init__(
            model=model,
            reward_funcs=[speed, proximity],
            args=args,
            train_dataset=self.context_pool.candidate_dataset(),
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            peft_config=peft_config,
        )
        # Our rollout replaces generation; set here rather than passed to __init__, where TRL warns that
        # rollout functions are experimental. TRL's _generate still decodes windows for its logs only.
        self.rollout_func = self._rollout
        if not getattr(self.target, "hf_device_map", None) and not getattr(self.target, "is_quantized", False):
            self.target.to(self.accelerator.device)
        # The target's features of the latest rollout's contexts, for a drafter reading them (kept for its loss).
        self._features = RolloutFeatures(self.target, self.family.target_layer_ids(model), self._tokenizer.pad_token_id)
        self._patch_drafter_forward()
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and self.accelerator.num_processes == 1:
            # Seen with torchrun / accelerate's MULTI_GPU+use_cpu config on machines without CUDA: every process
            # would silently train its own drafter.
            raise RuntimeError(
                f"{launched} processes were launched but each sees a world of 1. On a CPU-only machine pass "
                "--use_cpu True (PPOWConfig(use_cpu=True)) or set ACCELERATE_USE_CPU=true."
            )
        deepspeed_plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.is_fsdp_enabled or (deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3):
            # Calibration and evaluation run on the main process inside unwrap_model_for_generation, which gathers
            # sharded parameters collectively: the other ranks would deadlock. (Selection scoring runs on every
            # rank, but would need the gathered parameters each time.)
            raise NotImplementedError("PPOWTrainer supports DDP and DeepSpeed ZeRO-1/2, not FSDP or ZeRO-3.")

        # Two rules: the one the training rollouts draft with (fixed by the config, so the training distribution
        # and exact resume do not depend on evaluations), and the served one that save_model writes, replaced by
        # each calibration on held-out data.
        self.rollout_policy = AdaptiveWindowPolicy(args.max_window, args.window_threshold, args.confidence_temperature)
        self.window_policy = self.rollout_policy
        # Measured lazily (before the first rollout), after accelerator.prepare has placed the drafter: under
        # DeepSpeed the drafter is still on the CPU here.
        self._cost_model = cost_model
        self._cost_model_measured = False  # measured here (not given): re-measured after prepare if taken before
        self._greedy_continuations: dict[tuple, list[int]] = {}  # eval prompts -> the target's greedy text
        self.trained_window_tokens = 0  # drafted tokens the loss has trained on (this process; a budget measure)
        self.context_selector = ContextSelector(
            self.context_pool.lengths, beta=args.selection_beta, eps=args.selection_eps,
            uniform_share=args.selection_uniform_share, seed=args.seed,
        )
        # The latest batch's per-window terms, for inspection and tests (full p and q only when
        # args.keep_window_distributions: they are (B, K, V) and would otherwise live through the backward).
        self.last_window_rewards = None
        # Filled by the caller (e.g. the recipe) with what the model card should say: "target", "drafter",
        # "data", and "evaluation" (rows of ppow_trl.bench's summary) with "evaluation_setup".
        self.model_card_info: dict = {}

    # ------------------------------------------------------------------ set-up helpers

    def _unwrapped_drafter(self):
        return unwrap_model(self.model)

    def _patch_drafter_forward(self) -> None:
        """The loss's route into the drafter's own ``forward`` (``window_logprobs.install_loss_route``), reading the
        target features the latest rollout drafted from (``RolloutFeatures``)."""
        install_loss_route(self._unwrapped_drafter(), self.family, self.target, vocab_size=self.vocab_size,
                           shared_context=self.args.shared_context_logprobs, context_features=self._features)

    @property
    def cost_model(self) -> CostModel:
        """``t_d/t_t`` and ``t_v(L)/t_t``: given, restored from a checkpoint, or measured on first use."""
        if self._cost_model is None:
            self._cost_model = self._initial_cost_model()
            self._cost_model_measured = self.args.drafter_cost is None
        return self._cost_model

    @cost_model.setter
    def cost_model(self, value: CostModel) -> None:
        self._cost_model = value

    def _initial_cost_model(self) -> CostModel:
        """The given cost ratios, or a calibration on this machine (main process; broadcast to the others)."""
        if self.args.drafter_cost is not None:
            return CostModel(drafter_cost=self.args.drafter_cost, verify_cost=list(self.args.verify_cost),
                             description="given in PPOWConfig", drafter_per_round=self.family.cost_per_round)
        measured = [None]
        if self.accelerator.is_main_process:
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as drafter, _eval_mode(drafter):
                check_same_device(self.target, drafter)
                measured = [self._measure_cost_model(drafter)]
            measured[0].description = ("measured by PPOWTrainer before its first rollout (main process): "
                                       + measured[0].description)
        if self.accelerator.num_processes > 1:
            # The whole object (raw seconds and description included), not only the ratios.
            broadcast_object_list(measured, from_process=0)
        return measured[0]

    def _measure_cost_model(self, drafter) -> CostModel:
        """``t_d``, ``t_v(L)`` on the runtime that will serve (``args.runtime``, ``args.serving_precision``), so that the speed reward pays for
        what serving costs: on the compiled runtime, the target and a merged copy of the drafter (its costs do not
        depend on the weights LoRA changes) are compiled, once per machine with the disk cache."""
        if self.args.runtime != "eager":
            drafter = copy.deepcopy(unwrap_model(drafter))
            drafter = (drafter.merge_and_unload() if hasattr(drafter, "merge_and_unload") else drafter).eval()
        runtime = serving_runtime(self.target, drafter, runtime=self.args.runtime, max_window=self.args.max_window,
                                  precision=self.args.serving_precision,
                                  drafter_precision=self.args.drafter_serving_precision,
                                  settings=self.args.compile_settings())
        return runtime.measure_cost_model(self.args.max_window, vocab_size=self.vocab_size)

    # ------------------------------------------------------------------ sampling of contexts

    def _generation_round(self) -> int:
        """Index of the generation round about to run: one round feeds steps_per_generation x num_iterations
        micro-batches. Micro-batches done = global_step x gradient_accumulation_steps + those of the current
        optimizer step (TRL's ``_step`` restarts at 0 on resume, always on a step boundary)."""
        accumulation = self.args.gradient_accumulation_steps
        micro_batches = self.state.global_step * accumulation + self._step % accumulation
        return micro_batches // (self.args.steps_per_generation * self.num_iterations)

    def _select_contexts(self, inputs: list[dict]) -> list[dict]:
        """Replace the dataloader's rows by this round's divergence-aware choice (same global draw on every
        process; each takes its slice), each context repeated G times as GRPO expects."""
        group = self.num_generations
        local = len(inputs) // group
        chosen = self.context_selector.draw(self._generation_round(), local * self.accelerator.num_processes)
        mine = chosen[self.accelerator.process_index * local : (self.accelerator.process_index + 1) * local].tolist()
        self._round_candidates = mine  # the contexts' places in the training text (cached rewards read it)
        return [{"candidate": c, "prompt": self.context_pool.context(c)} for c in mine for _ in range(group)]

    def _refresh_selection_scores(self) -> None:
        """Rescore a rotating subset of sequences with the current drafter (``ppow_trl.training.contexts.refresh_scores``)."""
        args = self.args
        pad_id = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as drafter, _eval_mode(drafter):
            refresh_scores(self.context_selector, self.context_pool, self.target, drafter, self.accelerator,
                           count=args.selection_refresh_sequences, vocab_size=self.vocab_size,
                           target_temperature=self._verify_temperature, drafter_temperature=args.temperature,
                           kind=args.selection_divergence, pad_id=pad_id,
                           greedy_from_text=args.reward_source == "cache")
        self.context_selector.last_refresh_step = self.state.global_step

    # ------------------------------------------------------------------ rollout and rewards

    @property
    def _verify_temperature(self) -> float:
        return 0.0 if self.args.acceptance == "greedy" else self.args.verify_temperature

    def window_rewards(self, verified: VerifiedWindows) -> dict[str, torch.Tensor]:
        """The reward terms of docs/ppow.md for verified windows (``ppow_trl.core.rollout.window_rewards`` with this
        run's cost model, speed reward and proximity settings)."""
        cost_model = self.cost_model if self.args.speed_reward == "cost" else None
        return window_rewards(verified, cost_model, proximity_divergence=self.args.proximity_divergence,
                              proximity_weight=self.args.proximity_weight,
                              proximity_positions=self.args.proximity_positions)

    def _cached_next_tokens(self, contexts: list[torch.Tensor]) -> torch.Tensor | None:
        """The training text's next ``K + 1`` tokens after each context of this round (``reward_source="cache"``), or
        ``None`` where the rows are not this round's training contexts (evaluation rollouts: the target verifies)."""
        candidates = getattr(self, "_round_candidates", None)
        if self.args.reward_source != "cache" or not self.model.training or candidates is None:
            return None
        sequences, starts = self.context_pool.locate(candidates)
        if len(candidates) != len(contexts) or any(
                len(c) != len(self.context_pool.prompts[q]) + int(t) for c, q, t in zip(contexts, sequences, starts)):
            raise RuntimeError("The rollout's contexts are not this round's selected contexts.")
        return cached_next_tokens([self.context_pool.responses[q] for q in sequences], starts, self.args.max_window + 1)

    def _rollout(self, prompts: list[list[int]], trainer=None) -> dict:
        """Draft G windows per context, verify them with the target, and compute the rewards."""
        group = self.num_generations if self.model.training else self.num_generations_eval
        contexts = [torch.tensor(p, dtype=torch.long) for p in prompts[::group]]
        if any(prompts[i] != prompts[i - i % group] for i in range(len(prompts))):
            raise RuntimeError("PPOWTrainer expects the G windows of a context on consecutive rows (TRL's sampler layout).")
        pad_id = self._tokenizer.pad_token_id
        # Windows are sampled from a generator seeded by (seed, round, process): the stream is a function of
        # the training step, so a resumed run samples what the uninterrupted run sampled.
        generator = torch.Generator(self.accelerator.device).manual_seed(
            (self.args.seed * 1_000_003 + self._generation_round()) * 1_009 + self.accelerator.process_index
        )
        features = None
        if self._features.layer_ids is not None:  # kept for the loss, which replays these windows from them
            features = self._features.keep(contexts)
        next_tokens = self._cached_next_tokens(contexts)  # before eval mode: it serves training rollouts only
        # Drafted in eval mode (no dropout), as served: the windows and their log-probs are the served drafter's.
        with unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
        ) as drafter, torch.no_grad(), _eval_mode(drafter):
            if next_tokens is None:
                verified = verify_windows(self.target, drafter, contexts, self.rollout_policy,
                                          greedy=self.args.acceptance == "greedy", temperature=self.args.temperature,
                                          verify_temperature=self._verify_temperature, pad_id=pad_id,
                                          vocab_size=self.vocab_size, generator=generator,
                                          num_samples_per_context=group, features=features)
                target_rows = len(verified.prefix)
            else:
                verified, target_rows = verify_windows_from_cache(
                    drafter, contexts, next_tokens, self.rollout_policy, target=self.target,
                    temperature=self.args.temperature, pad_id=pad_id, vocab_size=self.vocab_size, generator=generator,
                    num_samples_per_context=group, features=features)
            self._log_metric("ppow/target_verified_share", target_rows / max(len(verified.prefix), 1))
        drafted, target_probs = verified.drafted, verified.target_probs
        terms = self.window_rewards(verified)
        self._log_window_metrics(terms, drafted, target_probs)
        sampled_logq = drafted.drafter_probs.gather(-1, drafted.window_ids.unsqueeze(-1)).squeeze(-1).clamp_min(1e-30).log()
        self.last_window_rewards = {**terms, "window_ids": drafted.window_ids, "window_mask": drafted.window_mask,
                                    "confidences": drafted.confidences, "sampled_logq": sampled_logq}
        if self.args.keep_window_distributions:
            self.last_window_rewards.update(drafter_probs=drafted.drafter_probs, target_probs=target_probs)
        del target_probs, verified  # (B, K + 1, V): freed before the loss's backward, unless kept above

        lengths = terms["lengths"].tolist()
        credit = terms["credit"]
        return {
            "prompt_ids": [list(p) for p in prompts],
            "completion_ids": [row[:n] for row, n in zip(drafted.window_ids.tolist(), lengths)],
            "logprobs": [row[:n] for row, n in zip(sampled_logq.tolist(), lengths)],
            "ppow_speed": terms["speed"].tolist(),
            "ppow_proximity": terms["proximity"].tolist(),
            "ppow_credit": [row[:n] for row, n in zip(credit.tolist(), lengths)],
        }

    def _log_window_metrics(self, terms, drafted, target_probs) -> None:
        """Per-batch means through TRL's metric buffer (reduced across processes, logged via report_to)."""
        selected = divergence(target_probs[:, :1], drafted.drafter_probs[:, :1], self.args.selection_divergence)
        values = {
            "ppow/expected_accepted": terms["accepted"].mean(),
            "ppow/simulated_tau": terms["accepted"].mean() + 1.0,
            "ppow/window_length": terms["lengths"].float().mean(),
            "ppow/full_window_ratio": (terms["lengths"] == self.args.max_window).float().mean(),
            "ppow/R_speed": terms["speed"].mean(),
            "ppow/R_prox": terms["proximity"].mean(),
            "ppow/selected_divergence": selected.mean(),
            "ppow/cost_ratio": torch.tensor(self.cost_model.drafter_cost),
        }
        for name, value in values.items():
            self._log_metric(name, float(value))

    def _generate_and_score_completions(self, inputs):
        if self.model.training:
            last = self.context_selector.last_refresh_step
            if self.args.selection_beta > 0 and (
                last is None or self.state.global_step - last >= self.args.selection_refresh_steps
            ):
                self._refresh_selection_scores()
            inputs = self._select_contexts(inputs)
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.trained_window_tokens += int(output["completion_mask"].sum())
        if self.args.per_token_credit != "none" and self.model.training:
            width = output["completion_ids"].shape[1]
            credit = torch.zeros(len(inputs), width, device=output["completion_ids"].device)
            for row, example in enumerate(inputs):
                credit[row, : len(example["ppow_credit"])] = torch.tensor(example["ppow_credit"])
            mask = output["completion_mask"].float()
            # Groups are process-local (PPOWConfig checks it), so the per-position statistics need no gather.
            per_position = per_position_advantages(credit, mask, self.num_generations,
                                                   scale=self.args.scale_rewards != "none")
            if self.args.per_token_credit == "add":
                per_position = output["advantages"].unsqueeze(-1) * mask + per_position
            output["advantages"] = per_position
        return output

    def _prepare_inputs(self, generation_batch):
        """TRL's buffering of a generation batch, shuffled group by group instead of row by row.

        Keeping the G windows of a context in the same micro-batch lets the loss compute that context once
        (``shared_context_logprobs``); the rows of one micro-batch are still a uniform draw of groups.
        """
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            rows = len(batch["prompt_ids"])
            groups = torch.randperm(rows // self.num_generations)
            order = (groups[:, None] * self.num_generations + torch.arange(self.num_generations)).flatten()
            batch = {key: _index_rows(value, order, rows) for key, value in batch.items()}
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """Log-probs of the window tokens with each context computed once (``ppow_trl.training.window_logprobs``).

        Runs through ``model``'s forward (DDP/PEFT wrappers included) on the drafter's ``ppow_window_logprobs``
        route. TRL's generic path is used when ``shared_context_logprobs=False``, for a model without the route
        (a separate reference model), or with activation checkpointing (no KV cache in train mode).
        """
        inner = self.accelerator.unwrap_model(model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        # Checkpointed layers drop the KV cache in training (also when enabled on the model, e.g. by
        # peft.prepare_model_for_kbit_training), so the windows could not see their context there.
        checkpointed = (self.args.activation_checkpointing or self.args.gradient_checkpointing
                        or any(getattr(m, "gradient_checkpointing", False) for m in inner.modules()))
        use_shared = (self.args.shared_context_logprobs and getattr(inner, "_ppow_window_logprobs", False)
                      and not compute_aux_loss and not any(v is not None for v in multimodal.values())
                      and not checkpointed)
        if not use_shared:
            head_rows = inner.get_output_embeddings().weight.shape[0]
            if not isinstance(inner, ReducedVocabHeadMixin) and head_rows != self.vocab_size:
                raise ValueError(
                    f"TRL's generic loss path (used here because of activation checkpointing, an MoE aux loss or a "
                    f"model without PPOW's route) normalises over all {head_rows} head rows, but the rollout samples "
                    f"over the {self.vocab_size} tokens of the tokenizer. Turn activation checkpointing off (drafters "
                    "are small) so the shared-context path runs."
                )
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        route = {"num_window_tokens": logits_to_keep, "vocab_size": self.vocab_size, "temperature": self.temperature,
                 "compute_entropy": compute_entropy, "cast_lm_head_to_fp32": self.args.cast_lm_head_to_fp32}
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                chunk_logps, chunk_entropy = model(input_ids=input_ids[rows], attention_mask=attention_mask[rows],
                                                   ppow_window_logprobs=route)
            logps.append(chunk_logps)
            entropies.append(chunk_entropy)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # ------------------------------------------------------------------ training, calibration, evaluation

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """TRL's training loop, then (``calibrate_window``) the window rule calibrated on ``eval_dataset``, so
        that ``save_model`` writes a rule matched to the drafter it saves."""
        args = self.args
        generate_every = args.steps_per_generation * self.num_iterations
        if resume_from_checkpoint and args.gradient_accumulation_steps % generate_every:
            # A generation round would straddle an optimizer step: a resumed run would regenerate the round's
            # windows with updated weights (and TRL's buffer is not checkpointed), so the resume is not exact.
            raise ValueError(
                f"Exact resume needs generation rounds that end on optimizer steps: gradient_accumulation_steps "
                f"({args.gradient_accumulation_steps}) must be a multiple of steps_per_generation x num_iterations "
                f"({args.steps_per_generation} x {self.num_iterations}). Use steps_per_generation = "
                "gradient_accumulation_steps and num_iterations = 1, or train without resuming."
            )
        if self._cost_model_measured:
            # Measured by an evaluation or calibration before train(): the drafter was not prepared yet (device,
            # mixed precision). Measure again before the first rollout; a resumed run restores its own.
            self._cost_model, self._cost_model_measured = None, False
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                               ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        if args.calibrate_window:
            self.calibrate_window_policy()
        return output

    def _held_out(self, dataset=None):
        dataset = dataset if dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            dataset = next(iter(dataset.values()))
        return dataset

    def calibrate_window_policy(self, dataset=None) -> AdaptiveWindowPolicy | None:
        """Set ``self.window_policy`` to the ``(K <= max_window, h)`` that maximises the cost-model speedup on
        held-out contexts of ``dataset`` (default ``eval_dataset``) in ``args.calibration_regime``
        (``ppow_trl.serving.calibration.calibrate_policy``); returns it, or None without held-out data.

        Runs on the main process; the result is broadcast so every process holds the same rule.
        """
        dataset = self._held_out(dataset)
        if dataset is None:
            logger.warning("No eval_dataset: the window rule stays K = %d, h = %.2f (not calibrated on held-out "
                           "data). Pass eval_dataset= (held-out target responses) to calibrate it.",
                           self.window_policy.max_window, self.window_policy.threshold)
            return None
        args, cost_model = self.args, self.cost_model
        result = [None]
        if self.accelerator.is_main_process:
            contexts = held_out_contexts(dataset["prompt_ids"], dataset["response_ids"],
                                         args.calibration_contexts_per_response, args.calibration_max_contexts)
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as drafter, _eval_mode(drafter):
                policy, _ = calibrate_policy(
                    self.target, drafter, contexts, cost_model, max_window=args.max_window,
                    regime=args.calibration_regime, temperature=args.temperature,
                    confidence_temperature=args.confidence_temperature, vocab_size=self.vocab_size,
                    pad_id=self._tokenizer.pad_token_id, batch_size=args.per_device_eval_batch_size, seed=args.seed,
                )
            result = [policy]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(result, from_process=0)
        self.window_policy = result[0]
        logger.info("Window rule calibrated on %d held-out contexts (%s): K = %d, h = %.2f, predicted speedup %.3f",
                    self.window_policy.calibration["num_contexts"], args.calibration_regime,
                    self.window_policy.max_window, self.window_policy.threshold,
                    self.window_policy.calibration["predicted_speedup"])
        return self.window_policy

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Held-out acceptance during training (``eval_strategy``/``eval_steps``, usable as ``metric_for_best_model``).

        On the held-out target responses: the window rule is recalibrated (``calibrate_window``), then
        - ``eval_tau``: exact greedy tau of ``speculative_generate`` at that rule (tokens / verification
          forwards, bonus token included, ratio of sums over ``eval_num_prompts`` prompts of
          ``eval_max_new_tokens`` tokens; deterministic), and ``eval_tau_fixed_window`` at ``K = max_window``, h = 0;
        - ``eval_expected_accepted``: mean E[A|y] (A when ``acceptance="greedy"``) of windows drafted at
          ``temperature`` under the rule after held-out contexts, as the training reward defines it, and
          ``eval_simulated_speedup``, their cost-model speedup (ratio of sums);
        - ``eval_predicted_speedup``, ``eval_window_max``, ``eval_window_threshold``: the calibration's result.
        """
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if dataset is None:
            raise ValueError("PPOWTrainer.evaluate needs eval_dataset: held-out target responses "
                             "(ppow_trl.data.build_target_responses on prompts not used for training).")
        self.cost_model  # measured (a collective) on every process before the main-process-only work below
        was_training = self.model.training
        self.model.eval()
        try:
            if self.args.calibrate_window:
                self.calibrate_window_policy(dataset)
            # Exact greedy tau (the costly part: the target's greedy text per prompt) is sharded over the processes
            # and summed; the sampled-window metrics run on the main process and are broadcast.
            counts = self._held_out_tau_counts(dataset)
            if self.accelerator.num_processes > 1:
                counts = self.accelerator.reduce(counts, reduction="sum")
            values = torch.zeros(5, device=self.accelerator.device)
            if self.accelerator.is_main_process:
                values = torch.tensor(self._held_out_window_metrics(dataset), device=self.accelerator.device)
            if self.accelerator.num_processes > 1:
                values = broadcast(values, from_process=0)
            tau = counts[0] / counts[1].clamp_min(1), counts[2] / counts[3].clamp_min(1)
            values = torch.cat([torch.stack(tau).to(values.device), values])
            metrics = {f"{metric_key_prefix}_{name}": float(v) for name, v in zip(keys(PPOW_EVAL), values.tolist(),
                                                                                  strict=True)}
            self.log(metrics)
        finally:
            self.model.train(was_training)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _eval_rows(self, dataset):
        count = self.args.eval_num_prompts
        return dataset if count is None else dataset.select(range(min(count, len(dataset))))

    def _held_out_tau_counts(self, dataset) -> torch.Tensor:
        """This process's share (prompts ``rank::world``) of exact greedy tau: ``[tokens, rounds]`` at the served
        rule, then at ``K = max_window``, h = 0. ``(4,)`` float on the accelerator's device."""
        acc, policy = self.accelerator, self.window_policy
        prompts = self._eval_rows(dataset)["prompt_ids"][acc.process_index :: acc.num_processes]
        with unwrap_model_for_generation(self.model_wrapped, acc) as drafter, _eval_mode(drafter):
            counts = held_out_tau_counts(self.target, drafter, prompts,
                                         [policy, policy.with_window(self.args.max_window, 0.0)],
                                         max_new_tokens=self.args.eval_max_new_tokens, vocab_size=self.vocab_size,
                                         continuations=self._greedy_continuations)
        return counts.float().to(acc.device)

    def _held_out_window_metrics(self, dataset) -> list[float]:
        """E[A|y] and the cost-model speedup of windows sampled under the served rule after held-out contexts, and
        the calibration's figures (main process)."""
        args, policy = self.args, self.window_policy
        rows = self._eval_rows(dataset)
        contexts = held_out_contexts(rows["prompt_ids"], rows["response_ids"], args.calibration_contexts_per_response,
                                     args.calibration_max_contexts)
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as drafter, _eval_mode(drafter):
            measured = held_out_window_metrics(
                self.target, drafter, contexts, policy, self.cost_model, greedy=args.acceptance == "greedy",
                temperature=args.temperature, verify_temperature=self._verify_temperature,
                pad_id=self._tokenizer.pad_token_id, vocab_size=self.vocab_size,
                batch_size=args.per_device_eval_batch_size, seed=args.seed)
        calibration = policy.calibration or {}
        return [measured["expected_accepted"], measured["simulated_speedup"],
                float(calibration.get("predicted_speedup", float("nan"))), float(policy.max_window),
                float(policy.threshold)]

    # ------------------------------------------------------------------ saving and resuming

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            # Generation reads the rule and the costs that training used from the drafter's folder; HF's
            # `assistant_model=` path applies the rule through custom_generate/ (see ppow_trl/serving/assisted.py).
            write_assistant_files(output_dir, self.window_policy, self._cost_model, vocab_size=self.vocab_size,
                                  hook=self.family.writes_hook_file)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """README.md for the drafter folder: target, drafter, data, hyperparameters, window rule, cost model
        and (when ``model_card_info["evaluation"]`` is set) the measured tau / speedup table."""
        if not self.is_world_process_zero():
            return
        info = self.model_card_info
        drafter = self._unwrapped_drafter()
        card = render_model_card(
            model_name=model_name or Path(self.args.output_dir).name,
            target=info.get("target", self.target.config._name_or_path or self.target.config.model_type),
            drafter=info.get("drafter", f"{type(drafter).__name__}, {drafter.num_parameters() / 1e6:.1f}M parameters"),
            data=info.get("data", dataset_name or f"{len(self.context_pool.responses)} target-generated responses"),
            args=self.args,
            policy=self.window_policy,
            cost_model=self._cost_model,
            evaluation=info.get("evaluation"),
            evaluation_setup=info.get("evaluation_setup", ""),
            hub_model_id=self.hub_model_id,
            adapter=hasattr(self.accelerator.unwrap_model(self.model), "peft_config"),
            family=self.family,
        )
        write_model_card(self.args.output_dir, card)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            # A tensor file (float32 scores, bool flags): a JSON list of every candidate's score does not scale.
            self.context_selector.save_state(os.path.join(folder, SELECTOR_STATE_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SELECTOR_STATE_FILE)
        legacy = os.path.join(checkpoint, "ppow_context_selector.json")  # what PPOWTrainer wrote before the .pt file
        if not os.path.exists(path) and os.path.exists(legacy):
            path = legacy
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: this checkpoint was not written by PPOWTrainer.")
        self.context_selector.load_state(path)
        if self.args.drafter_cost is None and os.path.exists(os.path.join(checkpoint, COST_MODEL_FILE)):
            # The costs measured by the interrupted run, not a new (noisy) measurement: same rewards as before.
            self.cost_model = CostModel.from_pretrained(checkpoint)


@contextlib.contextmanager
def _eval_mode(model):
    """``model.eval()`` for the block, then its previous mode."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _index_rows(value, order: torch.Tensor, rows: int):
    """Reorder the rows of one entry of TRL's batch dict (tensors and lists with one item per row)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value[order.to(value.device)]
    if isinstance(value, list) and len(value) == rows:
        return [value[i] for i in order.tolist()]
    return value


def _max_positions(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None) or 1 << 30
