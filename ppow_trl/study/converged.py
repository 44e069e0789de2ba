"""The converged study: KD to convergence, then PPOW and its rivals refine the converged drafter at equal extra budget.

    python benchmarks/study_converged.py                   # everything; reruns skip finished stages
    python benchmarks/study_converged.py --stage converge  # only the converged drafters
    python benchmarks/study_converged.py --report-only     # summary.json and docs/benchmarks-archive.md from the JSON

Stage 1 (``converge``), per family (the truncated drafter, the EAGLE-3 head): KD on the study's data (``StudyData``:
the target's greedy responses to 640 ShareGPT prompts, 56k tokens, its top-32) until the held-out exact greedy
tau stops rising: ``KDTrainer`` with ``eval_tau_window`` and transformers' ``EarlyStoppingCallback``
(``metric_for_best_model="eval_tau"``, ``patience`` evaluations), the best checkpoint restored. Checkpoints make it
resumable: a rerun continues from the last one.

Stage 2 (``arms``), from each converged drafter, every arm for ``extra_seconds`` of optimizer-step time, under
``seeds``:

- ``kd_more``: KD continued (same loss, learning rate and data);
- ``ppow_cache``: PPOW with greedy rewards from the cached text (``reward_source="cache"``);
- ``ppow_t1``: PPOW with T = 1 rewards (E[A|y] under speculative sampling, the target verifying every window);
- ``on_policy``: on-policy distillation (DistillSpec; TRL's GKD with ``lmbda = 1``): windows drafted by the drafter,
  the target's top-k distribution at every window position, forward KL + TV (``ppow_trl.training.on_policy``);
- ``ppow_dense``: ``ppow_cache`` plus the dense per-position credit (``per_token_credit="add"``).

Every arm is evaluated as the study evaluates (``runner.evaluate_arm``): exact greedy tau on the 80 MT-bench first
turns and the held-out ShareGPT prompts at fixed K and at the converged drafter's calibrated rule, and T = 1
closed-form E[A|y] on MT-bench. Results: ``benchmarks/results/study_converged/``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .arms import EAGLE3_BUILD, Arm
from .evaluate import SAMPLES_PER_CONTEXT
from .runner import StudyConfig

RESULTS = Path("benchmarks/results/study_converged")
WORK = Path("outputs/study_converged")
FAMILIES = {"truncated": Arm("converge", "kd", "KD to convergence"),
            "eagle3": Arm("converge", "kd", "KD to convergence", drafter="eagle3", build=EAGLE3_BUILD)}
SAMPLING_SETS = ("mtbench", "sharegpt_test")  # T = 1 closed-form E[A|y] on both test sets
# The EAGLE-3 head's evaluation runs the target over every prompt for its features (~1 s a prompt here, 4x the
# truncated drafter's): its arms are evaluated at fixed K only (the primary measure) and probed at start and end.
QUICK_EVALUATION = ("eagle3",)
ARMS = ("kd_more", "ppow_cache", "ppow_t1", "on_policy", "ppow_dense")


@dataclass(frozen=True)
class ConvergedConfig:
    """Everything a converged-study result depends on (saved in each result; a change reruns it)."""

    study: StudyConfig = field(default_factory=StudyConfig)
    eval_steps: int = 20  # KD optimizer steps between held-out tau measurements
    patience: int = 4  # evaluations without a new best before KD stops
    # KD's step cap per family: the EAGLE-3 head's steps cost ~2x the truncated drafter's here (TTT unroll, the
    # target's features), so its cap is what 2 cores allow in this study's time, stated as such in the results.
    max_kd_steps: tuple[tuple[str, int], ...] = (("truncated", 500), ("eagle3", 240))
    extra_seconds: float = 180.0  # each arm's optimizer-step time after the converged point
    probe_every_seconds: float = 90.0
    seeds: tuple[int, ...] = (0, 1)
    on_policy_contexts_per_step: int = 4
    on_policy_windows_per_context: int = 2
    on_policy_learning_rate: float = 1e-4
    on_policy_top_k: int = 32

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def smoke(cls) -> ConvergedConfig:
        return cls(study=StudyConfig.smoke(), eval_steps=2, patience=1, max_kd_steps=(("truncated", 4), ("eagle3", 4)),
                   extra_seconds=4.0,
                   probe_every_seconds=2.0, seeds=(0,), on_policy_contexts_per_step=2)


def _json_equal(a, b) -> bool:
    return json.loads(json.dumps(a)) == json.loads(json.dumps(b))


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------ stage 1: converge


def converge(family: str, config: ConvergedConfig, results: Path = RESULTS, work: Path = WORK) -> dict:
    """KD until the held-out exact greedy tau stops rising; saves the best drafter, its cost model and rule."""

    from transformers import EarlyStoppingCallback, set_seed

    from ..serving.assisted import save_assistant
    from ..data import stop_token_ids
    from ..drafting import get_family
    from ..training.kd_trainer import KDConfig, KDTrainer
    from ..utils import set_cpu_threads
    from .data import train_topk
    from .runner import _build_drafter, _cost_and_policy, _load, _result, evaluate_arm

    threads = set_cpu_threads()
    study, arm = config.study, FAMILIES[family]
    set_seed(study.seed)
    target, tokenizer, train, calibration, tests, draft_vocab = _load(study)
    eos = stop_token_ids(target, tokenizer)
    data = train_topk(target, train, study.data)
    drafter = _build_drafter(arm, study, target, tokenizer, draft_vocab).train()
    layer_ids = get_family(arm.family).target_layer_ids(drafter)
    if layer_ids is not None:
        from .data import train_features

        data = train_features(target, data, layer_ids, study.data)
    folder = work / f"{family}_kd"
    max_steps = dict(config.max_kd_steps)[family]
    args = KDConfig(output_dir=str(folder / "trainer"), loss=arm.kd_loss, max_steps=max_steps,
                    per_device_train_batch_size=study.kd_batch_size, learning_rate=study.kd_learning_rate,
                    lr_scheduler_type="constant_with_warmup", warmup_steps=20, logging_steps=10,
                    eval_strategy="steps", eval_steps=config.eval_steps, save_strategy="steps",
                    save_steps=config.eval_steps, save_total_limit=2, load_best_model_at_end=True,
                    metric_for_best_model="eval_tau", greater_is_better=True, eval_tau_window=study.probe_max_window,
                    eval_max_new_tokens=study.data.train_max_new_tokens, report_to="none", disable_tqdm=True,
                    max_length=640, seed=study.seed, use_cpu=True)
    trainer = KDTrainer(model=drafter, args=args, train_dataset=data, eval_dataset=calibration,
                        processing_class=tokenizer, target=target,
                        callbacks=[EarlyStoppingCallback(early_stopping_patience=config.patience)])
    checkpoints = sorted((folder / "trainer").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    clock = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(checkpoints[-1]) if checkpoints else None)
    seconds = time.perf_counter() - clock
    drafter = trainer.model.eval()
    cost, policy = _cost_and_policy(target, tokenizer, drafter, calibration, study)
    save_assistant(drafter, work / f"{family}_converged", policy=policy, cost_model=cost, tokenizer=tokenizer)
    curve = [{"step": row["step"], "held_out_tau_fixed_k": row["eval_tau"]} for row in trainer.state.log_history
             if "eval_tau" in row]
    trained = {"optimizer_steps": trainer.state.global_step, "best_step": _best_step(trainer),
               "trained_positions": trainer.trained_positions,
               "max_steps": max_steps, "stopped_early": trainer.state.global_step < max_steps}
    result = _result(f"{family}_converged", "KD to convergence (early stopping on eval_tau)", study, threads, None,
                     trained, policy, cost,
                     evaluate_arm(target, tokenizer, drafter, policy, tests, study, eos, SAMPLING_SETS,
                                  samples_per_context=SAMPLES_PER_CONTEXT), seconds,
                     trainer, history=curve)
    result.update(converged_config=config.to_dict(), sampling_samples_per_context=SAMPLES_PER_CONTEXT)
    _write(results / f"converged_{family}.json", result)
    return result


def _best_step(trainer) -> int | None:
    best = trainer.state.best_model_checkpoint
    return None if best is None else int(Path(best).name.split("-")[1])


def arm_finished(family: str, arm: str, seed: int, config: ConvergedConfig, results: Path = RESULTS) -> bool:
    path = results / "arms" / f"{family}_{arm}_s{seed}.json"
    return path.is_file() and _json_equal(json.loads(path.read_text()).get("converged_config"), config.to_dict())


# --------------------------------------------------------------------------------------------- stage 2: arms

# PPOWConfig fields of each PPOW arm over the study's settings.
PPOW_ARMS = {
    "ppow_cache": {"acceptance": "greedy", "reward_source": "cache"},
    "ppow_t1": {"acceptance": "expected", "verify_temperature": 1.0},
    "ppow_dense": {"acceptance": "greedy", "reward_source": "cache", "per_token_credit": "add"},
}


def run_arm(family: str, arm: str, seed: int, config: ConvergedConfig, results: Path = RESULTS,
            work: Path = WORK) -> dict:
    """One arm from the family's converged drafter for ``extra_seconds`` of optimizer-step time, then evaluated at
    fixed K and at the converged drafter's calibrated rule (one rule for every arm: the comparison is of drafters)."""
    from transformers import set_seed

    from ..serving.assisted import load_cost_model, save_assistant
    from ..data import stop_token_ids
    from ..utils import set_cpu_threads
    from ..core.windowing import AdaptiveWindowPolicy
    from .runner import _load, _load_drafter, _probe, _result, evaluate_arm

    if arm not in ARMS:
        raise ValueError(f"Unknown arm {arm!r}; choose one of {ARMS}.")
    start = work / f"{family}_converged"
    if not (start / "config.json").is_file():
        raise FileNotFoundError(f"{start} holds no converged drafter: run --stage converge first.")
    threads = set_cpu_threads()
    study = config.study
    set_seed(seed)
    target, tokenizer, train, calibration, tests, _ = _load(study)
    eos = stop_token_ids(target, tokenizer)
    probe = _probe(target, calibration, study, len(tokenizer), eos)
    quick = family in QUICK_EVALUATION
    probe_every = config.extra_seconds if quick else config.probe_every_seconds
    drafter = _load_drafter(start, target).train()
    policy = AdaptiveWindowPolicy.from_pretrained(start)
    cost = load_cost_model(start)
    clock = time.perf_counter()
    if arm == "kd_more":
        drafter, trained, curve, log = _kd_more(drafter, target, tokenizer, train, study, config, seed, probe,
                                                probe_every)
    elif arm == "on_policy":
        drafter, trained, curve, log = _on_policy(drafter, target, tokenizer, train, study, config, seed, probe,
                                                  probe_every)
    else:
        drafter, trained, curve, log = _ppow(drafter, target, tokenizer, train, calibration, study, config, seed,
                                             probe, probe_every, cost, PPOW_ARMS[arm],
                                             work / "trainer" / f"{family}_{arm}_s{seed}")
    seconds = time.perf_counter() - clock
    # loadable by `python -m ppow_trl.bench --drafter` (the measured speed of the best arms)
    save_assistant(drafter.eval(), work / f"{family}_{arm}_s{seed}", policy=policy, cost_model=cost, tokenizer=tokenizer)
    result = _result(f"{family}_{arm}", ARM_DESCRIPTIONS[arm], study, threads, None, trained, policy, cost,
                     evaluate_arm(target, tokenizer, drafter.eval(), policy, tests, study, eos, SAMPLING_SETS,
                                  rules=("fixed_k",) if quick else ("policy", "fixed_k"),
                                  samples_per_context=SAMPLES_PER_CONTEXT), seconds, None,
                     history=curve)
    result.update(family=family, seed=seed, converged_config=config.to_dict(), train_log=log,
                  sampling_samples_per_context=SAMPLES_PER_CONTEXT)
    _write(results / "arms" / f"{family}_{arm}_s{seed}.json", result)
    return result


ARM_DESCRIPTIONS = {
    "kd_more": "KD continued from the converged drafter",
    "ppow_cache": "PPOW, greedy rewards from the cached text",
    "ppow_t1": "PPOW, T = 1 rewards (target-verified E[A|y])",
    "on_policy": "On-policy distillation (drafted windows, target top-k at every position, KL + TV)",
    "ppow_dense": "PPOW (cached greedy rewards) plus dense per-position credit",
}


def _kd_more(drafter, target, tokenizer, train, study, config, seed, probe, probe_every):
    import tempfile

    from ..drafting import family_of
    from ..training.kd_trainer import KDConfig, KDTrainer
    from .budget import TrainingBudget
    from .data import train_features, train_topk

    data = train_topk(target, train, study.data)
    layer_ids = family_of(drafter).target_layer_ids(drafter)
    if layer_ids is not None:
        data = train_features(target, data, layer_ids, study.data)
    budget = TrainingBudget(config.extra_seconds, probe=probe, probe_every=probe_every)
    # Constant learning rate, as the converging run used (no warm-up: the optimizer restarts, the drafter does not).
    args = KDConfig(output_dir=tempfile.mkdtemp(prefix="converged-kd-"), max_steps=10**6,
                    per_device_train_batch_size=study.kd_batch_size, learning_rate=study.kd_learning_rate,
                    lr_scheduler_type="constant", logging_steps=10, save_strategy="no", report_to="none",
                    disable_tqdm=True, max_length=640, seed=seed, use_cpu=True)
    trainer = KDTrainer(model=drafter, args=args, train_dataset=data, processing_class=tokenizer, target=target,
                        callbacks=[budget])
    trainer.train()
    trained = {"optimizer_steps": trainer.state.global_step, "trained_positions": trainer.trained_positions,
               "train_step_seconds": budget.elapsed}
    return trainer.model, trained, budget.history, _numeric_log(trainer)


def _on_policy(drafter, target, tokenizer, train, study, config, seed, probe, probe_every):
    from ..training.contexts import ContextPool
    from ..training.on_policy import train_on_policy

    out = train_on_policy(drafter, target, ContextPool(train), seconds=config.extra_seconds,
                          learning_rate=config.on_policy_learning_rate,
                          contexts_per_step=config.on_policy_contexts_per_step,
                          windows_per_context=config.on_policy_windows_per_context, max_window=study.max_window,
                          top_k=config.on_policy_top_k, vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id,
                          seed=seed, probe=probe, probe_every=probe_every)
    trained = {key: out[key] for key in ("optimizer_steps", "trained_window_tokens", "train_step_seconds")}
    return drafter, trained, out["curve"], out["log"]


def _ppow(drafter, target, tokenizer, train, calibration, study, config, seed, probe, probe_every, cost, fields,
          output_dir):
    import copy

    from peft import LoraConfig

    from ..drafting import family_of
    from ..training.ppow_config import PPOWConfig
    from ..training.ppow_trainer import PPOWTrainer
    from .budget import TrainingBudget

    settings = dict(output_dir=str(output_dir), max_window=study.max_window, window_threshold=study.window_threshold,
                    num_generations=study.num_generations,
                    per_device_train_batch_size=study.ppow_contexts_per_step * study.num_generations,
                    learning_rate=study.ppow_learning_rate, lr_scheduler_type="constant", max_steps=10**5,
                    logging_steps=10, save_strategy="no", report_to="none", eval_strategy="no",
                    load_best_model_at_end=False, selection_refresh_steps=20, selection_refresh_sequences=32,
                    seed=seed, disable_tqdm=True, use_cpu=True, calibrate_window=False,
                    # the converged drafter's measured cost model (same architecture: the same costs)
                    drafter_cost=cost.drafter_cost, verify_cost=list(cost.verify_cost)[: study.max_window + 1])
    settings.update(fields)
    budget = TrainingBudget(config.extra_seconds, probe=probe, probe_every=probe_every)
    lora = LoraConfig(r=study.lora_r, lora_alpha=2 * study.lora_r, task_type=family_of(drafter).peft_task_type,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = PPOWTrainer(model=drafter, target_model=target, args=PPOWConfig(**settings), train_dataset=train,
                          processing_class=tokenizer, peft_config=lora, callbacks=[budget])
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    merged = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
    trained = {"optimizer_steps": trainer.state.global_step, "trained_window_tokens": trainer.trained_window_tokens,
               "train_step_seconds": budget.elapsed}
    return merged, trained, budget.history, _numeric_log(trainer)


def _numeric_log(trainer) -> list[dict]:
    return [{k: v for k, v in row.items() if isinstance(v, (int, float))} for row in trainer.state.log_history]


def resample_sampling(path: Path, work: Path = WORK) -> None:
    """Recompute a finished result's T = 1 records with ``SAMPLES_PER_CONTEXT`` windows per prompt, from its saved
    drafter (results written before the evaluation drew several windows per prompt)."""
    from ..utils import set_cpu_threads
    from ..core.windowing import AdaptiveWindowPolicy
    from .evaluate import sampled_records
    from .runner import _load, _load_drafter

    result = json.loads(path.read_text())
    if result.get("sampling_samples_per_context") == SAMPLES_PER_CONTEXT:
        return
    set_cpu_threads()
    study = ConvergedConfig().study
    name = result["arm"] if "seed" not in result else f"{result['arm']}_s{result['seed']}"
    target, tokenizer, _, _, tests, _ = _load(study)
    drafter = _load_drafter(work / name, target)
    policy = AdaptiveWindowPolicy.from_pretrained(work / name)
    fixed = AdaptiveWindowPolicy(study.eval_max_window, 0.0, policy.confidence_temperature)
    rules = {key: p for key, p in (("policy", policy), ("fixed_k", fixed)) if key in result["evaluation"]["greedy"]["mtbench"]}
    for test_set in SAMPLING_SETS:
        result["evaluation"]["sampling"][test_set] = sampled_records(
            target, drafter, tests[test_set], rules, max_window=max(p.max_window for p in rules.values()),
            vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id, seed=study.seed,
            samples_per_context=SAMPLES_PER_CONTEXT)
    result["sampling_samples_per_context"] = SAMPLES_PER_CONTEXT
    _write(path, result)


def converged_finished(family: str, config: ConvergedConfig, results: Path = RESULTS) -> bool:
    path = results / f"converged_{family}.json"
    return path.is_file() and _json_equal(json.loads(path.read_text()).get("converged_config"), config.to_dict())


# ------------------------------------------------------------------------------------------------ command line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=["converge", "arms", "all"], default="all")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (1 torch thread each)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=WORK)
    parser.add_argument("--benchmarks-md", type=Path, default=Path("docs/benchmarks-archive.md"))
    parser.add_argument("--smoke", action="store_true", help="tiny data and budgets: test the pipeline in minutes")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--run", nargs=3, metavar=("FAMILY", "ARM", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--resample", type=Path, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}.")
    config = ConvergedConfig.smoke() if args.smoke else ConvergedConfig()
    if args.resample:
        for path in args.resample:
            resample_sampling(path, args.work)
        return
    if args.run:
        family, arm, seed = args.run
        if arm == "converge":
            converge(family, config, args.results, args.work)
        else:
            run_arm(family, arm, int(seed), config, args.results, args.work)
        return
    if not args.report_only:
        extra = ("--smoke",) if args.smoke else ()
        if args.stage in ("converge", "all"):
            _run_all([(f, "converge", 0) for f in args.families if not converged_finished(f, config, args.results)],
                     args, extra)
        if args.stage in ("arms", "all"):
            todo = [(f, a, s) for f in args.families for s in config.seeds for a in args.arms
                    if not arm_finished(f, a, s, config, args.results)]
            _run_all(todo, args, extra)
    from .converged_report import write_report

    write_report(args.results, args.benchmarks_md)


def _run_all(runs: list[tuple[str, str, int]], args, extra: tuple[str, ...]) -> None:
    """Each run in its own process (``--run``), ``args.jobs`` at a time; logs under ``<results>/logs``."""
    from tqdm.auto import tqdm

    logs = args.results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    running, failed, todo = {}, [], list(runs)
    with tqdm(total=len(todo), desc="converged study", unit="run") as progress:
        while todo or running:
            for key, process in list(running.items()):
                if process.poll() is not None:
                    running.pop(key)
                    progress.update(1)
                    if process.returncode:
                        failed.append(key)
            while todo and len(running) < args.jobs:
                family, arm, seed = key = todo.pop(0)
                command = [sys.executable, "-m", "ppow_trl.study.converged", "--run", family, arm, str(seed),
                           "--results", str(args.results), "--work", str(args.work), *extra]
                log = open(logs / f"{family}_{arm}_s{seed}.log", "w")  # noqa: SIM115 - closed with the process
                running[key] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            progress.set_postfix_str(",".join(f"{f}/{a}/s{s}" for f, a, s in running) or "-")
            time.sleep(5)
    if failed:
        raise RuntimeError(f"Runs {failed} failed: see {logs}/<family>_<arm>_s<seed>.log.")


if __name__ == "__main__":
    main()
