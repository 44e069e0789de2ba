"""Which training data buys more tau per CPU-hour: the data routes on the same CPU budget, side by side.

Each route gets the same wall-clock for its data (``--data-minutes``) and for KD (``--kd-minutes``) on the launched
processes, then its drafter (the main job's: the target's first 2 layers, an 8,192-token head from the target's top-1)
is evaluated the same way:

- ``regenerated``: the target's own greedy answers (``build_target_responses``: batches of 64 length-sorted prompts, a
  bf16 copy of the target where the CPU has avx512_bf16 / AMX, labels from the same pass, <= 128 new tokens);
- ``teacher_forced``: ShareGPT's own answers (<= 256 tokens) labelled in one forward each (``build_teacher_forced``,
  bf16 autocast where the CPU has it), EAGLE-1's route;
- ``mixed``: half of the data time on each, the regenerated half on the shortest prompts (the main job's mix).

Data is built slice by slice (``--slice-prompts`` prompts a slice, each slice timed and cached) until the route's
budget is spent; KD runs the number of steps that fit its budget at the speed a short probe measures on that route's
data (lr 5e-4, cosine, 10% warm-up, length-grouped batches, bf16 autocast where the CPU has it, the target's
embedding frozen: as the recipe runs it). Evaluation (main process): exact greedy tau at K = 4 (ratio of sums, 95%
bootstrap interval over prompts) on ``--mtbench`` MT-bench and ``--code`` code prompts, the target's own greedy text.

Results go to ``benchmarks/results/data_routes.json`` after each route and each slice; a rerun skips finished routes
and reads finished slices from the cache with their recorded build times. The routes share the slices (``mixed`` reads
the other routes' first slices back): every slice counts at what it cost when it was built.

    accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml benchmarks/data_routes.py
    python benchmarks/data_routes.py --data-minutes 0.5 --kd-minutes 0.5 --slice-prompts 16 --mtbench 2 --code 2 \\
        --out /tmp/routes.json                                                # a smoke run in one process
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import transformers
from accelerate import PartialState
from datasets import concatenate_datasets
from transformers import AutoTokenizer

from ppow_trl.core.windowing import AdaptiveWindowPolicy
from ppow_trl.data import (build_target_responses, build_teacher_forced, encode_prompt, load_prompts,
                           load_sharegpt_conversations, stop_token_ids, target_top1_ids)
from ppow_trl.models import build_draft_vocab, load_target, make_drafter
from ppow_trl.offline import smollm2_path
from ppow_trl.study.evaluate import greedy_records, summarize
from ppow_trl.training.kd_trainer import KDConfig, KDTrainer
from ppow_trl.utils import cache_root, cpu_summary, resolve_precision, set_cpu_threads

ROUTES = ("regenerated", "teacher_forced", "mixed")
COLUMNS = ["prompt_ids", "response_ids", "topk_ids", "topk_logprobs"]
FIXED = AdaptiveWindowPolicy(4, 0.0)


def spend(budget_seconds: float, slices: int, build, recorded: list[float]) -> tuple[list, list[float]]:
    """Build slices ``0, 1, ...`` with ``build(i) -> (dataset, seconds)`` until ``budget_seconds`` are spent (a slice
    that starts within the budget finishes) or ``slices`` run out. ``recorded`` holds the seconds of the slices built
    so far, an earlier run's included (those are read back from the cache now and count at what they cost then); each
    new slice's seconds are appended to it as soon as it is built. Returns the datasets and the seconds of every slice."""
    parts, seconds = [], []
    for index in range(slices):
        if sum(seconds) >= budget_seconds:
            break
        dataset, took = build(index)
        parts.append(dataset)
        if index >= len(recorded):
            recorded.append(took)
        seconds.append(recorded[index])
    return parts, seconds


def timed(state, build):
    """``build()`` between two barriers: ``(result, seconds)``, the main process's clock given to every process (the
    budget's decisions must be the same on all of them, or they would wait for each other at different barriers)."""
    state.wait_for_everyone()
    start = time.perf_counter()
    result = build()
    state.wait_for_everyone()
    seconds = [time.perf_counter() - start]
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        broadcast_object_list(seconds, from_process=0)
    return result, seconds[0]


def kd_args(output_dir: Path, steps: int, batch_size: int, bf16: bool) -> KDConfig:
    return KDConfig(output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=batch_size,
                    learning_rate=5e-4, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 10),
                    logging_steps=max(1, steps // 10), save_strategy="no", report_to="none", seed=0,
                    use_cpu=not torch.cuda.is_available(), bf16_autocast=bf16, train_sampling_strategy="group_by_length")


def fresh_drafter(target, tokenizer, data):
    drafter = make_drafter(target, num_layers=2, draft_vocab_ids=build_draft_vocab(
        [target_top1_ids(data)], 8192, len(tokenizer), always_include=tokenizer.all_special_ids)).train()
    drafter.get_input_embeddings().requires_grad_(False)  # the target's embedding, kept (as the recipe's KD does)
    return drafter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", nargs="+", choices=ROUTES, default=list(ROUTES))
    parser.add_argument("--data-minutes", type=float, default=20.0)
    parser.add_argument("--kd-minutes", type=float, default=10.0)
    parser.add_argument("--slice-prompts", type=int, default=256, help="prompts built and timed at a time")
    parser.add_argument("--pool", type=int, default=10000, help="ShareGPT train prompts the slices are cut from")
    parser.add_argument("--batch-size", type=int, default=8, help="KD sequences per process and step")
    parser.add_argument("--mtbench", type=int, default=80)
    parser.add_argument("--code", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/data_routes.json"))
    parser.add_argument("--work", type=Path, default=None, help="the routes' data caches (default: the ppow_trl cache)")
    args = parser.parse_args(argv)
    if min(args.data_minutes, args.kd_minutes) <= 0 or args.slice_prompts < 1:
        parser.error("--data-minutes and --kd-minutes must be positive and --slice-prompts >= 1.")

    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(hours=3))  # evaluation: one process
    threads = set_cpu_threads()
    work = args.work or cache_root() / "data_routes"
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"routes": {}}
    settings = {"data_minutes": args.data_minutes, "kd_minutes": args.kd_minutes, "slice_prompts": args.slice_prompts,
                "pool": args.pool, "batch_size": args.batch_size, "mtbench": args.mtbench, "code": args.code,
                "processes": state.num_processes, "threads": threads}
    if results["routes"] and results.get("settings") != settings:
        parser.error(f"{args.out} holds routes of other settings ({results.get('settings')}): pass another --out.")
    path = smollm2_path()
    target = load_target(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = stop_token_ids(target, tokenizer)
    precision = resolve_precision("auto")  # bf16 where the CPU has avx512_bf16 / AMX, else fp32

    prompts = load_prompts("sharegpt", num_samples=args.pool, seed=0)
    conversations = load_sharegpt_conversations("train", num_samples=args.pool, seed=0)
    # the regenerated route answers the shortest prompts first (a decode step pays a prefill per prompt)
    by_length = sorted(range(len(prompts)), key=lambda i: len(encode_prompt(tokenizer, prompts[i]["messages"])))
    tests = {"mtbench": load_prompts("mtbench", num_samples=args.mtbench),
             "code": load_prompts("code", num_samples=args.code)}
    tests = {name: build_target_responses(target, tokenizer, rows, max_new_tokens=128, batch_size=8,
                                          cache_dir=cache_root() / "responses" / "data_routes")
             for name, rows in tests.items() if len(rows)}
    slice_of = lambda order, i: order[i * args.slice_prompts:(i + 1) * args.slice_prompts]  # noqa: E731
    slices = (len(prompts) + args.slice_prompts - 1) // args.slice_prompts

    def regenerate(i):
        rows = prompts.select(slice_of(by_length, i))
        return timed(state, lambda: build_target_responses(
            target, tokenizer, rows, max_new_tokens=128, batch_size=64, chunk_size=64, label_top_k=32,
            precision=precision, cache_dir=work / "responses").select_columns(COLUMNS))

    def teacher_force(i):
        rows = conversations.select(slice_of(list(reversed(by_length)), i))  # the longer prompts: not the target's
        return timed(state, lambda: build_teacher_forced(
            target, tokenizer, rows, max_response_tokens=256, batch_size=8, precision=precision,
            cache_dir=work / "teacher-forced").select_columns(COLUMNS))

    results.update(settings=settings, cpu=cpu_summary(), torch=torch.__version__,
                   transformers=transformers.__version__, precision_of_data=precision,
                   command=("accelerate launch --config_file recipes/accelerate_configs/cpu_2proc.yaml "
                            if state.num_processes > 1 else "python ") + "benchmarks/data_routes.py "
                   + " ".join(sys.argv[1:] if argv is None else argv))
    budget = 60 * args.data_minutes
    for route in args.routes:
        if route in results["routes"]:
            continue
        # a slice costs what it cost when first built, whichever route built it (the routes share the slices' caches)
        recorded = results.setdefault("slice_seconds", {})
        parts, seconds = [], {}
        for name, build, share in (("regenerated", regenerate, 1.0 if route == "regenerated" else 0.5),
                                   ("teacher_forced", teacher_force, 1.0 if route == "teacher_forced" else 0.5)):
            if route != "mixed" and name != route:
                continue
            def saved(i, build=build, name=name):  # each slice's cost is on disk once built: a killed run resumes
                out = build(i)
                if state.is_main_process:
                    recorded.setdefault(name, [])
                    if i == len(recorded[name]):
                        recorded[name].append(out[1])
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1) + "\n")
                return out

            built, seconds[name] = spend(share * budget, slices, saved, list(recorded.get(name, [])))
            parts += built
        data = concatenate_datasets(parts)
        tokens = sum(map(len, data["response_ids"]))
        global_batch = args.batch_size * state.num_processes
        bf16 = precision == "bf16"
        # KD steps that fit the budget, at the speed of a short probe on this route's data
        probe_steps = 6
        probe = KDTrainer(model=fresh_drafter(target, tokenizer, data), args=kd_args(
            work / f"probe-{route}", probe_steps, args.batch_size, bf16), train_dataset=data,
            processing_class=tokenizer, target=target)
        _, probe_seconds = timed(state, probe.train)
        steps = max(1, int(60 * args.kd_minutes / (probe_seconds / probe_steps)))
        drafter = fresh_drafter(target, tokenizer, data)
        trainer = KDTrainer(model=drafter, args=kd_args(work / f"kd-{route}", steps, args.batch_size, bf16),
                            train_dataset=data, processing_class=tokenizer, target=target)
        _, kd_seconds = timed(state, trainer.train)
        if state.is_main_process:
            drafter = trainer.accelerator.unwrap_model(trainer.model).eval()
            with torch.no_grad():
                evaluation = {name: summarize(greedy_records(target, drafter, rows, FIXED, max_new_tokens=128,
                                                             eos_token_ids=eos, vocab_size=len(tokenizer)))
                              for name, rows in tests.items()}
            results["routes"][route] = {
                "train_tokens": tokens, "sequences": len(data),
                "data_seconds": {name: sum(s) for name, s in seconds.items()},
                "kd_steps": steps, "global_batch": global_batch, "kd_seconds": kd_seconds,
                "epochs": steps * global_batch / max(len(data), 1), "evaluation": evaluation}
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1) + "\n")
            mt = evaluation.get("mtbench", {})
            print(f"[data_routes] {route}: {tokens} tokens, {steps} KD steps; MT-bench tau K=4 {mt.get('tau', 0):.3f} "
                  f"{mt.get('tau_ci')}", flush=True)
        state.wait_for_everyone()
        results = json.loads(args.out.read_text()) if args.out.is_file() else results
    return 0


if __name__ == "__main__":
    sys.exit(main())
