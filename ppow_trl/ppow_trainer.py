"""PPOWTrainer: GRPO on speculative windows, with the target model as verifier.

The drafter is the policy. For each context (a prefix of a target-generated response, chosen by the
divergence-aware sampler) it samples G windows of up to K tokens under the adaptive stop rule; the
frozen target verifies each window in one forward that reuses the context's KV cache; the shared core
turns the distributions into E[A|y] (or A), S(y) and R_prox; TRL's group-relative advantages and
clipped loss do the rest. No text is decoded for rewards: everything works on token ids and
probabilities.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
from accelerate.utils import broadcast
from transformers import AutoModelForCausalLM
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.models.utils import unwrap_model_for_generation

from .contexts import ContextPool, ContextSelector, score_sequence
from .cost import COST_MODEL_FILE, CostModel, calibrate_cost_model, speedup
from .drafter import PPOWDrafterForCausalLM
from .model_card import render_model_card, write_model_card
from .models import check_compatibility, load_target
from .ppow_config import PPOWConfig
from .rewards import divergence, proximity_reward
from .rollout import draft_windows, target_window_probs
from .verification import window_prefix_acceptance
from .windowing import AdaptiveWindowPolicy

SELECTOR_STATE_FILE = "ppow_context_selector.json"


# TRL needs reward functions (and names them in its logs: rewards/speed/mean, rewards/proximity/mean).
# Our rollout computes both terms from token ids and probabilities and hands them over per row.
def speed(prompts, completions, ppow_speed, **kwargs):
    """R_speed of each window, computed in the rollout (``PPOWTrainer.window_rewards``)."""
    return ppow_speed


def proximity(prompts, completions, ppow_proximity, **kwargs):
    """R_prox of each window, computed in the rollout (``PPOWTrainer.window_rewards``)."""
    return ppow_proximity


def accepted_tokens_to_go(prefix_acceptance: torch.Tensor) -> torch.Tensor:
    """Per-token credit ``G_k = sum_{j>=k} P(A >= j | y)``: expected accepted tokens from position k on.

    ``G_1 = E[A|y]``; token k can only contribute if all of 1..k are accepted, and each ``P(A >= j)``,
    ``j >= k``, depends on it.
    """
    return prefix_acceptance.flip(-1).cumsum(-1).flip(-1)


def per_token_advantages(credit: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group-relative per-position advantages ``(G_{b,k} - mean_g G_{.,k}) / (std_g G_{.,k} + 1e-4)``. ``(B, K)``.

    Rows are ordered group by group (``group_size`` consecutive windows share a context); positions a
    window does not reach count as 0 credit; the result is 0 on padding.
    """
    grouped = (credit * mask).view(-1, group_size, credit.shape[-1])
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + 1e-4)).view_as(credit) * mask


class PPOWTrainer(GRPOTrainer):
    """Trains a drafter with GRPO on window-level speculative rewards from a frozen target verifier.

    Args:
        model: the drafter (a causal LM sharing the target's tokenizer, e.g. from `ppow_trl.make_drafter`),
            or a path to one.
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
            raise NotImplementedError(
                "eval_dataset is not supported yet; evaluate tau on held-out prompts with ppow_trl's evaluation tools."
            )
        if train_dataset is None:
            raise ValueError("Pass train_dataset: target-generated responses (ppow_trl.data.build_target_responses).")
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model)
        if isinstance(target_model, str):
            target_model = load_target(target_model, quantization=args.target_quantization)
        self.vocab_size = check_compatibility(target_model, model, processing_class, drafter_processing_class)
        room = min(_max_positions(target_model), _max_positions(model)) - (args.max_window + 1)
        self.context_pool = ContextPool(train_dataset, max_context_length=room)

        # Frozen verifier: eval mode, no gradients, never wrapped or prepared by accelerate.
        self.target = target_model.eval().requires_grad_(False)
        args.reward_weights = [1.0, args.proximity_weight]
        if args.beta > 0 and peft_config is None and isinstance(model, PPOWDrafterForCausalLM):
            raise ValueError(
                "beta > 0 with a reduced-vocabulary drafter needs a peft_config (the reference is then the drafter "
                "with its adapter disabled); or set beta=0 (the default)."
            )
        super().__init__(
            model=model,
            reward_funcs=[speed, proximity],
            args=args,
            train_dataset=self.context_pool.candidate_dataset(),
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
        self._map_fused_head_labels_to_draft_rows()
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
            # Scoring and calibration run on the main process inside unwrap_model_for_generation, which gathers
            # sharded parameters collectively: the other ranks would deadlock.
            raise NotImplementedError("PPOWTrainer supports DDP and DeepSpeed ZeRO-1/2, not FSDP or ZeRO-3.")

        self.window_policy = AdaptiveWindowPolicy(args.max_window, args.window_threshold)
        self.cost_model = cost_model or self._initial_cost_model()
        self.context_selector = ContextSelector(
            len(self.context_pool), beta=args.selection_beta, eps=args.selection_eps,
            uniform_share=args.selection_uniform_share, seed=args.seed,
        )
        self.last_window_rewards = None  # the latest batch's reward terms, for inspection and tests
        # Filled by the caller (e.g. the recipe) with what the model card should say: "target", "drafter",
        # "data", and "evaluation" (rows of ppow_trl.bench's summary) with "evaluation_setup".
        self.model_card_info: dict = {}

    # ------------------------------------------------------------------ set-up helpers

    def _unwrapped_drafter(self):
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _map_fused_head_labels_to_draft_rows(self) -> None:
        """TRL scores log-probs with a fused head over `get_output_embeddings()`; for a reduced-vocabulary
        drafter that head has draft rows, so target-id labels are mapped to draft rows first. Without this
        the log-probs are silently wrong (docs/design/trainer-notes.md, section 0)."""
        drafter = self._unwrapped_drafter()
        if not isinstance(drafter, PPOWDrafterForCausalLM):
            return
        fused_forward = drafter.forward

        @functools.wraps(fused_forward)
        def forward(*args, fused_lm_head=False, labels=None, **kwargs):
            if fused_lm_head and labels is not None:
                labels = drafter.draft_index(labels)
            return fused_forward(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)

        drafter.forward = forward

    def _initial_cost_model(self) -> CostModel:
        """The given cost ratios, or a calibration on this machine (main process; broadcast to the others)."""
        if self.args.drafter_cost is not None:
            return CostModel(drafter_cost=self.args.drafter_cost, verify_cost=list(self.args.verify_cost),
                             description="given in PPOWConfig")
        ratios = torch.zeros(self.args.max_window + 2, device=self.accelerator.device)
        if self.accelerator.is_main_process:
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as drafter:
                measured = calibrate_cost_model(self.target, drafter, self.args.max_window)
            ratios = torch.tensor([measured.drafter_cost, *measured.verify_cost], device=self.accelerator.device)
        ratios = broadcast(ratios, from_process=0).tolist()
        return CostModel(drafter_cost=ratios[0], verify_cost=ratios[1:],
                         description="measured at start-up by PPOWTrainer (main process)")

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
        return [{"candidate": c, "prompt": self.context_pool.context(c)} for c in mine for _ in range(group)]

    def _refresh_selection_scores(self) -> None:
        """Rescore a rotating subset of sequences with the current drafter: ``s_t = conf_t * D(p_t, q_t)``."""
        selector, pool, args = self.context_selector, self.context_pool, self.args
        num_sequences = len(pool.responses)
        count = min(args.selection_refresh_sequences, num_sequences)
        first = (selector.refresh_count * count) % num_sequences
        sequences = [(first + i) % num_sequences for i in range(count)]
        scores = torch.zeros(len(pool), device=self.accelerator.device)
        scored = torch.zeros(len(pool), device=self.accelerator.device)
        if self.accelerator.is_main_process:
            with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as drafter:
                for sequence in sequences:
                    row = score_sequence(
                        self.target, drafter, pool.sequence_ids(sequence), len(pool.prompts[sequence]),
                        vocab_size=self.vocab_size, target_temperature=self._verify_temperature,
                        drafter_temperature=args.temperature, kind=args.selection_divergence,
                    )
                    candidates = pool.offsets[sequence] + torch.arange(len(row))
                    scores[candidates] = row.to(scores.device)
                    scored[candidates] = 1.0
        scores, scored = broadcast(scores, from_process=0), broadcast(scored, from_process=0)
        selector.set_scores(scored.nonzero().squeeze(-1).cpu(), scores[scored.bool()].cpu())
        selector.last_refresh_step = self.state.global_step
        selector.refresh_count += 1

    # ------------------------------------------------------------------ rollout and rewards

    @property
    def _verify_temperature(self) -> float:
        return 0.0 if self.args.acceptance == "greedy" else self.args.verify_temperature

    def window_rewards(self, window_ids, drafter_probs, window_mask, target_probs) -> dict[str, torch.Tensor]:
        """The reward terms of PPOW.md for a batch of windows, from the shared core.

        Returns ``accepted`` (E[A|y], or A when ``acceptance="greedy"``), ``prefix`` (P(A >= k)),
        ``lengths`` (L), ``speed`` (R_speed) and ``proximity`` (R_prox).
        """
        prefix = window_prefix_acceptance(window_ids, target_probs, drafter_probs, window_mask,
                                          greedy=self.args.acceptance == "greedy")
        accepted = prefix.sum(dim=-1)  # A (greedy) or E[A|y] = sum_k prod_{i<=k} alpha_i
        lengths = window_mask.sum(-1)
        r_speed = speedup(accepted, lengths, self.cost_model) if self.args.speed_reward == "cost" else accepted + 1.0
        r_prox = proximity_reward(target_probs, drafter_probs, window_mask, kind=self.args.proximity_divergence)
        return {"accepted": accepted, "prefix": prefix, "lengths": lengths, "speed": r_speed, "proximity": r_prox}

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
        with unwrap_model_for_generation(
            self.model_wrapped, self.accelerator, gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
        ) as drafter, torch.no_grad():
            drafted = draft_windows(drafter, contexts, self.window_policy, pad_id=pad_id, temperature=self.args.temperature,
                                    vocab_size=self.vocab_size, num_samples_per_context=group, generator=generator)
        target_probs = target_window_probs(self.target, contexts, drafted.window_ids, pad_id=pad_id,
                                           temperature=self._verify_temperature, vocab_size=self.vocab_size,
                                           num_samples_per_context=group)
        target_probs = target_probs.to(drafted.drafter_probs.device)
        terms = self.window_rewards(drafted.window_ids, drafted.drafter_probs, drafted.window_mask, target_probs)
        self.last_window_rewards = {**terms, "window_ids": drafted.window_ids, "drafter_probs": drafted.drafter_probs,
                                    "window_mask": drafted.window_mask, "target_probs": target_probs}
        self._log_window_metrics(terms, drafted, target_probs)

        lengths = terms["lengths"].tolist()
        sampled_logq = drafted.drafter_probs.gather(-1, drafted.window_ids.unsqueeze(-1)).squeeze(-1).clamp_min(1e-30).log()
        credit = accepted_tokens_to_go(terms["prefix"])
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
        if self.args.per_token_credit and self.model.training:
            width = output["completion_ids"].shape[1]
            credit = torch.zeros(len(inputs), width, device=output["completion_ids"].device)
            for row, example in enumerate(inputs):
                credit[row, : len(example["ppow_credit"])] = torch.tensor(example["ppow_credit"])
            mask = output["completion_mask"].float()
            # The window advantage (R_speed, lambda R_prox, as TRL normalised it) plus per-token credit for the
            # accepted tokens each position makes possible.
            output["advantages"] = (output["advantages"].unsqueeze(-1) * mask
                                    + per_token_advantages(credit, mask, self.num_generations))
        return output

    # ------------------------------------------------------------------ saving and resuming

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        output_dir = output_dir or self.args.output_dir
        if self.args.should_save:
            # Generation reads the rule and the costs that training used from the drafter's folder; HF's
            # `assistant_model=` path applies the rule through custom_generate/ (see ppow_trl/assisted.py).
            from .assisted import write_assistant_files

            write_assistant_files(output_dir, self.window_policy, self.cost_model)

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
            cost_model=self.cost_model,
            evaluation=info.get("evaluation"),
            evaluation_setup=info.get("evaluation_setup", ""),
            hub_model_id=self.hub_model_id,
            adapter=hasattr(self.accelerator.unwrap_model(self.model), "peft_config"),
        )
        write_model_card(self.args.output_dir, card)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, SELECTOR_STATE_FILE), "w") as f:
                json.dump(self.context_selector.state_dict(), f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, SELECTOR_STATE_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: this checkpoint was not written by PPOWTrainer.")
        with open(path) as f:
            self.context_selector.load_state_dict(json.load(f))
        if self.args.drafter_cost is None and os.path.exists(os.path.join(checkpoint, COST_MODEL_FILE)):
            # The costs measured by the interrupted run, not a new (noisy) measurement: same rewards as before.
            self.cost_model = CostModel.from_pretrained(checkpoint)


def _max_positions(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None) or 1 << 30
