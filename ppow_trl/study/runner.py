"""Run the study: data -> arms (each in its own process, ``jobs`` at a time) -> wall-clock -> report.

    python benchmarks/study.py                 # everything; reruns skip finished arms and cached data
    python benchmarks/study.py --arms kd ppow  # a subset
    python benchmarks/study.py --report-only   # regenerate docs/benchmarks-archive.md's study section from the JSON

Each arm writes ``<results>/arms/<name>.json`` (config, budget used, held-out tau curve, per-prompt records
of every evaluation) and saves its drafter under ``<work>/<name>`` (policy and cost model included, loadable
by ``ppow_trl.bench --drafter``). A result whose config differs from the current one is rerun.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..drafting import get_family, load_drafter
from .arms import ARMS, KD_ARM, ORDER, Arm, warm_start_of
from .data import StudyData

RESULTS = Path("benchmarks/results/study")
WORK = Path("outputs/study")


@dataclass(frozen=True)
class StudyConfig:
    """Everything an arm's result depends on (saved in each result; a change reruns the arm)."""

    data: StudyData = field(default_factory=StudyData)
    drafter_layers: int = 2
    draft_vocab_size: int = 8192
    budget_seconds: float = 900.0
    warm_seconds: float = 450.0
    probe_every_seconds: float = 90.0
    probe_max_window: int = 4
    eval_max_window: int = 4  # the fixed K every arm is also evaluated at
    max_window: int = 6  # K of the rollouts and of the calibration search
    kd_batch_size: int = 8
    kd_learning_rate: float = 5e-4
    ppow_learning_rate: float = 3e-4
    ppow_contexts_per_step: int = 4
    num_generations: int = 8
    window_threshold: float = 0.3
    lora_r: int = 16
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def smoke(cls) -> "StudyConfig":
        """A few-minute run of every stage on tiny data and budgets (tests the pipeline, measures nothing)."""
        data = StudyData(num_train_prompts=16, train_max_new_tokens=24, num_calibration=4, num_mtbench=3,
                         num_sharegpt_test=3, eval_max_new_tokens=24)
        return cls(data=data, draft_vocab_size=1024, budget_seconds=6.0, warm_seconds=3.0, probe_every_seconds=3.0,
                   ppow_contexts_per_step=2, num_generations=4)


def _load(config: StudyConfig):
    from transformers import AutoTokenizer

    from ..models import build_draft_vocab, load_target
    from ..offline import smollm2_path
    from .data import test_sets, train_responses

    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, calibration = train_responses(target, tokenizer, config.data)
    tests = test_sets(target, tokenizer, config.data)
    draft_vocab = build_draft_vocab(train["response_ids"], config.draft_vocab_size, len(tokenizer),
                                    always_include=tokenizer.all_special_ids)
    return target, tokenizer, train, calibration, tests, draft_vocab


def prepare_data(config: StudyConfig) -> dict:
    """Build (or load from the cache) every dataset; returns their sizes."""
    from .data import train_topk

    target, tokenizer, train, calibration, tests, _ = _load(config)
    topk = train_topk(target, train, config.data)
    return {"train_responses": len(train), "train_tokens": sum(map(len, train["response_ids"])),
            "calibration_responses": len(calibration), "topk_rows": len(topk),
            **{f"test_{name}": len(data) for name, data in tests.items()}}


# --------------------------------------------------------------------------------------------- one arm


def _probe(target, calibration, config: StudyConfig, vocab: int, eos: list[int]):
    from ..core.windowing import AdaptiveWindowPolicy
    from .evaluate import greedy_records, summarize

    fixed = AdaptiveWindowPolicy(config.probe_max_window)

    def probe(model) -> dict:
        was_training = model.training
        model.eval()
        try:
            records = greedy_records(target, model, calibration, fixed, max_new_tokens=config.data.train_max_new_tokens,
                                     eos_token_ids=eos, vocab_size=vocab)
        finally:
            model.train(was_training)
        return {"held_out_tau_fixed_k": summarize(records)["tau"]}

    return probe


def evaluate_arm(target, tokenizer, drafter, policy, tests, config: StudyConfig, eos: list[int],
                 sampling_sets: tuple[str, ...] = ("mtbench",), rules: tuple[str, ...] = ("policy", "fixed_k"),
                 samples_per_context: int = 1) -> dict:
    """Greedy records at the saved policy and at fixed K (``rules``) on every test set; T = 1 records on
    ``sampling_sets``."""
    from ..core.windowing import AdaptiveWindowPolicy
    from .evaluate import greedy_records, sampled_records

    vocab = len(tokenizer)
    fixed = AdaptiveWindowPolicy(config.eval_max_window, 0.0, policy.confidence_temperature)
    policies = {name: p for name, p in (("policy", policy), ("fixed_k", fixed)) if name in rules}
    drafter.eval()
    out = {"greedy": {}, "sampling": {}}
    for name, data in tests.items():
        out["greedy"][name] = {key: greedy_records(target, drafter, data, p, max_new_tokens=config.data.eval_max_new_tokens,
                                                   eos_token_ids=eos, vocab_size=vocab)
                               for key, p in policies.items()}
    for name in sampling_sets:
        out["sampling"][name] = sampled_records(target, drafter, tests[name], policies,
                                                max_window=max(policy.max_window, fixed.max_window), vocab_size=vocab,
                                                pad_id=tokenizer.pad_token_id, seed=config.seed,
                                                samples_per_context=samples_per_context)
    return out


def run_arm(name: str, config: StudyConfig, results: Path = RESULTS, work: Path = WORK) -> dict:
    """Train one arm to its budget, calibrate its window rule, evaluate it, save drafter and JSON."""
    from transformers import set_seed

    from ..serving.assisted import save_assistant
    from ..data import stop_token_ids
    from ..utils import set_cpu_threads

    threads = set_cpu_threads()
    arm = ARMS[name]
    set_seed(config.seed)
    target, tokenizer, train, calibration, tests, draft_vocab = _load(config)
    eos = stop_token_ids(target, tokenizer)
    vocab = len(tokenizer)
    probe = _probe(target, calibration, config, vocab, eos)
    clock = time.perf_counter()

    if arm.kind == "kd":
        drafter, budget, trainer = _train_kd(arm, config, target, tokenizer, train, draft_vocab, probe, work)
        cost, policy = _cost_and_policy(target, tokenizer, drafter, calibration, config)
        trained = {"optimizer_steps": trainer.state.global_step, "trained_positions": trainer.trained_positions}
    elif arm.kind == "eval":  # no parameters: evaluated as its family builds it
        drafter, budget, trainer = get_family(arm.family).build(target, tokenizer, **arm.build), None, None
        cost, policy = _cost_and_policy(target, tokenizer, drafter, calibration, config)
        trained = {"optimizer_steps": 0}
    else:
        drafter, budget, trainer = _train_ppow(arm, config, target, tokenizer, train, calibration, probe, work)
        cost, policy = trainer.cost_model, trainer.window_policy
        trained = {"optimizer_steps": trainer.state.global_step, "trained_window_tokens": trainer.trained_window_tokens}
    train_seconds = time.perf_counter() - clock
    save_assistant(drafter, work / name, policy=policy, cost_model=cost, tokenizer=tokenizer)
    result = _result(arm.name, arm.description, config, threads, budget, trained, policy, cost,
                     evaluate_arm(target, tokenizer, drafter, policy, tests, config, eos), train_seconds, trainer)
    _write(results / "arms" / f"{name}.json", result)
    if arm.saves_warm_start:
        _evaluate_warm(warm_start_of(arm.drafter), target, tokenizer, calibration, tests, config, eos, threads, results,
                       work, budget)
    return result


def _cost_and_policy(target, tokenizer, drafter, calibration, config: StudyConfig):
    """A KD drafter's measured cost model and its greedy window rule calibrated on the held-out responses (as
    PPOWTrainer does at the end of train(): 4 contexts per response)."""
    from ..serving.calibration import calibrate_policy, held_out_contexts
    from ..core.cost import calibrate_cost_model

    cost = calibrate_cost_model(target, drafter, config.max_window, repeats=9)
    contexts = held_out_contexts(calibration["prompt_ids"], calibration["response_ids"], 4)
    policy, _ = calibrate_policy(target, drafter, contexts, cost, max_window=config.max_window, regime="greedy",
                                 vocab_size=len(tokenizer), pad_id=tokenizer.pad_token_id)
    return cost, policy


def _evaluate_warm(name, target, tokenizer, calibration, tests, config, eos, threads, results, work, budget) -> None:
    """A KD arm's state at the warm-start point, evaluated like an arm (the start of its family's PPOW arms)."""
    drafter = _load_drafter(work / name, target)
    cost, policy = _cost_and_policy(target, tokenizer, drafter, calibration, config)
    warm = json.loads((work / name / "warm_start.json").read_text())
    history = [row for row in budget.history if row["train_seconds"] <= config.warm_seconds + 60]
    result = _result(name, "KD state at the warm-start point (start of its family's PPOW arms)", config, threads,
                     None, warm, policy, cost, evaluate_arm(target, tokenizer, drafter, policy, tests, config, eos),
                     warm["train_seconds"], None, history=history)
    _write(results / "arms" / f"{name}.json", result)


def _load_drafter(folder: Path, target):
    """A saved drafter of any family on the target's device, in eval mode (its family's ``load``)."""
    return load_drafter(folder, target=target).eval()


def _build_drafter(arm: Arm, config: StudyConfig, target, tokenizer, draft_vocab):
    """A fresh drafter of the arm's family: ``config.drafter_layers`` layers and the study's reduced head where the
    family has one, unless the arm's ``build`` says otherwise (``DrafterFamily.build``)."""
    family = get_family(arm.family)
    options = {"num_layers": config.drafter_layers, **arm.build}
    vocab = draft_vocab if family.reduced_head else None
    return family.build(target, tokenizer, draft_vocab_ids=vocab, seed=config.seed, **options)


def _train_kd(arm: Arm, config: StudyConfig, target, tokenizer, train, draft_vocab, probe, work: Path):
    import tempfile

    from ..training.kd_trainer import KDConfig, KDTrainer
    from .budget import TrainingBudget
    from .data import train_topk

    topk = train_topk(target, train, config.data)
    drafter = _build_drafter(arm, config, target, tokenizer, draft_vocab).train()
    layer_ids = get_family(arm.family).target_layer_ids(drafter)
    if layer_ids is not None:  # the drafter's inputs, cached (EAGLE-3 and DFlash read the same 2/15/27 column)
        from .data import train_features

        topk = train_features(target, topk, layer_ids, config.data)
    milestones, holder = {}, {}
    if arm.saves_warm_start:
        def save_warm(model):
            """The warm start of the family's PPOW arms: this arm's drafter after ``warm_seconds`` of training."""
            folder = work / warm_start_of(arm.drafter)
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            _write(folder / "warm_start.json", {"train_seconds": budget.elapsed,
                                                "optimizer_steps": holder["trainer"].state.global_step,
                                                "trained_positions": holder["trainer"].trained_positions,
                                                "config": config.to_dict()})
        milestones[config.warm_seconds] = save_warm
    budget = TrainingBudget(config.budget_seconds, probe=probe, probe_every=config.probe_every_seconds,
                            milestones=milestones)
    settings = dict(output_dir=tempfile.mkdtemp(prefix=f"study-{arm.name}-"), loss=arm.kd_loss, max_steps=10**6,
                    per_device_train_batch_size=config.kd_batch_size, learning_rate=config.kd_learning_rate,
                    lr_scheduler_type="constant_with_warmup", warmup_steps=20, logging_steps=50, save_strategy="no",
                    report_to="none", disable_tqdm=True, max_length=640, seed=config.seed, use_cpu=True)
    args = KDConfig(**{**settings, **arm.kd})  # the arm's own KD settings over the study's
    trainer = holder["trainer"] = KDTrainer(model=drafter, args=args, train_dataset=topk, processing_class=tokenizer,
                                            callbacks=[budget], target=target)
    trainer.train()
    return trainer.model.eval(), budget, trainer


def _train_ppow(arm: Arm, config: StudyConfig, target, tokenizer, train, calibration, probe, work: Path):
    from peft import LoraConfig

    from ..core.cost import calibrate_cost_model
    from ..training.ppow_config import PPOWConfig
    from ..training.ppow_trainer import PPOWTrainer
    from .budget import TrainingBudget

    warm = work / warm_start_of(arm.drafter)
    if not (warm / "warm_start.json").is_file():
        raise FileNotFoundError(f"{warm} has no warm start: run the '{arm.kd_arm}' arm first (it saves it).")
    if json.loads((warm / "warm_start.json").read_text()).get("config") != json.loads(json.dumps(config.to_dict())):
        raise ValueError(f"{warm} was trained under another study config: rerun the '{arm.kd_arm}' arm first.")
    drafter = _load_drafter(warm, target).train()
    settings = dict(output_dir=str(work / "trainer" / arm.name), max_window=config.max_window,
                    window_threshold=config.window_threshold, num_generations=config.num_generations,
                    per_device_train_batch_size=config.ppow_contexts_per_step * config.num_generations,
                    learning_rate=config.ppow_learning_rate, lr_scheduler_type="constant", max_steps=10**5,
                    logging_steps=10, save_strategy="no", report_to="none", eval_strategy="no",
                    load_best_model_at_end=False, selection_refresh_steps=20, selection_refresh_sequences=32,
                    seed=config.seed, disable_tqdm=True, use_cpu=True)
    settings.update(arm.ppow)
    args = PPOWConfig(**settings)
    budget = TrainingBudget(config.budget_seconds - config.warm_seconds, probe=probe,
                            probe_every=config.probe_every_seconds)
    # The cost model is measured before the budget starts, as for the KD arms (a set-up cost, not training).
    cost = calibrate_cost_model(target, drafter, config.max_window, repeats=9)
    lora = LoraConfig(r=config.lora_r, lora_alpha=2 * config.lora_r, task_type=get_family(arm.family).peft_task_type,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    trainer = PPOWTrainer(model=drafter, target_model=target, args=args, train_dataset=train, eval_dataset=calibration,
                          processing_class=tokenizer, peft_config=lora, callbacks=[budget], cost_model=cost)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    merged = copy.deepcopy(model).merge_and_unload() if hasattr(model, "merge_and_unload") else model
    # PPOW arms continue the warm start: their curve is shifted by its training time.
    for row in budget.history:
        row["train_seconds"] = round(row["train_seconds"] + config.warm_seconds, 2)
    return merged.eval(), budget, trainer


def _result(name, description, config, threads, budget, trained, policy, cost, evaluation, seconds, trainer,
            history=None) -> dict:
    log = [] if trainer is None else [
        {k: v for k, v in row.items() if isinstance(v, (int, float))} for row in trainer.state.log_history]
    return {
        "arm": name, "description": description, "config": config.to_dict(),
        "budget": {"train_step_seconds": None if budget is None else budget.elapsed, **trained},
        "wall_seconds": seconds,
        "curve": history if history is not None else ([] if budget is None else budget.history),
        "policy": {"max_window": policy.max_window, "threshold": policy.threshold,
                   "confidence_temperature": policy.confidence_temperature, "calibration": policy.calibration},
        "cost_model": {"drafter_cost": cost.drafter_cost, "verify_cost": list(cost.verify_cost),
                       "drafter_per_round": cost.drafter_per_round},
        "evaluation": evaluation, "train_log": log,
        "machine": {"platform": platform.platform(), "threads": threads, "precision": "fp32",
                    "cpu_count": os.cpu_count(), **_versions()},
    }


def _versions() -> dict:
    from importlib.metadata import version

    return {name: version(name) for name in ("torch", "transformers", "trl", "peft", "accelerate")}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------- orchestration


def finished(name: str, config: StudyConfig, results: Path = RESULTS) -> bool:
    path = results / "arms" / f"{name}.json"
    if not path.is_file():
        return False
    return json.loads(path.read_text()).get("config") == json.loads(json.dumps(config.to_dict()))


def run_arms(names: list[str], config: StudyConfig, jobs: int, results: Path = RESULTS, work: Path = WORK,
             extra_args: tuple[str, ...] = ()) -> None:
    """Run the unfinished arms in subprocesses, ``jobs`` at a time; PPOW arms wait for the warm start."""
    from tqdm.auto import tqdm

    todo = [n for n in ORDER if n in names and not finished(n, config, results)]
    budgets = {n: config.budget_seconds if ARMS[n].kind == "kd" else config.budget_seconds - config.warm_seconds
               for n in todo}
    for family, kd_arm in KD_ARM.items():  # a warm start is rebuilt with its KD arm: never start from an old one
        if kd_arm in todo:
            (work / warm_start_of(family) / "warm_start.json").unlink(missing_ok=True)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    logs = results / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    failed = []
    with tqdm(total=len(todo), desc="study arms", unit="arm") as progress:
        while todo or running:
            for name, (process, _) in list(running.items()):
                if process.poll() is not None:
                    running.pop(name)
                    progress.update(1)
                    if process.returncode:
                        failed.append(name)
            def can_start(n):
                arm = ARMS[n]
                if not arm.starts_from_warm:
                    return True
                warm_ready = (work / warm_start_of(arm.drafter) / "warm_start.json").is_file()
                return warm_ready or (arm.kd_arm not in running and arm.kd_arm not in todo)

            ready = [n for n in todo if can_start(n)]
            while ready and len(running) < jobs:
                name = ready.pop(0)
                todo.remove(name)
                command = [sys.executable, "-m", "ppow_trl.study", "--run-arm", name, "--results", str(results),
                           "--work", str(work), *extra_args]
                log = open(logs / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
                running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), time.time())
            left = sum(budgets[n] for n in todo) / max(jobs, 1) + max(
                [budgets[n] - (time.time() - start) for n, (_, start) in running.items()] + [0])
            progress.set_postfix_str(f"running {','.join(running) or '-'}; ~{left / 60:.0f} min of training left "
                                     "(+ evaluations)")
            time.sleep(5)
    if failed:
        raise RuntimeError(f"Arms {failed} failed: see {logs}/<arm>.log.")


def run_wallclock(config: StudyConfig, results: Path = RESULTS, work: Path = WORK, arms: tuple[str, ...] = ("kd", "ppow"),
                  num_prompts: int = 8, max_new_tokens: int = 64) -> None:
    """Wall-clock of the target alone, HF assisted generation (constant K, confidence 0.4), our loop and
    prompt lookup, interleaved prompt by prompt (``ppow_trl.bench``), for the named arms' drafters."""
    out = results / "wallclock"
    if (out.with_suffix(".json")).is_file():
        return
    command = [sys.executable, "-m", "ppow_trl.bench", "--modes", "greedy", "--num-prompts", str(num_prompts),
               "--max-new-tokens", str(max_new_tokens), "--methods", "target", "hf_assisted", "hf_confidence", "fast_fixed",
               "fast_adaptive", "prompt_lookup", "--output", str(out), "--no-progress"]
    for arm in arms:
        command += ["--drafter", str(work / arm)]
    subprocess.run(command, check=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ORDER), choices=list(ORDER))
    parser.add_argument("--jobs", type=int, default=2, help="arms trained at once (1 torch thread each)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON results go")
    parser.add_argument("--work", type=Path, default=WORK, help="where the drafters are saved")
    parser.add_argument("--benchmarks-md", type=Path, default=Path("docs/benchmarks-archive.md"),
                        help="the file whose study section is regenerated")
    parser.add_argument("--smoke", action="store_true", help="tiny data and budgets: test the pipeline in minutes")
    parser.add_argument("--run-arm", choices=list(ORDER), help=argparse.SUPPRESS)
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--skip-wallclock", action="store_true")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}.")
    config = StudyConfig.smoke() if args.smoke else StudyConfig()
    if args.run_arm:
        run_arm(args.run_arm, config, args.results, args.work)
        return
    from .report import write_report

    if not args.report_only:
        print("data:", prepare_data(config), flush=True)
        run_arms(args.arms, config, args.jobs, args.results, args.work, ("--smoke",) if args.smoke else ())
        if not args.skip_wallclock:
            run_wallclock(config, args.results, args.work, num_prompts=2 if args.smoke else 8,
                          max_new_tokens=8 if args.smoke else 64)
    write_report(args.results, args.benchmarks_md)
