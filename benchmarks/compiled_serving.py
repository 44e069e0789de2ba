"""The serving runtimes side by side: transformers' generate (eager, compiled) against ppow_trl's compiled runtime,
plain and speculative, greedy, batch 1, on MT-bench and code prompts, at each thread count asked for.

Rows (``ppow_trl.bench.served``; every arm runs on every prompt, back to back in a rotating order):

- ``hf_generate_eager``: ``target.generate``, dynamic cache, eager (the baseline most users have);
- ``hf_generate_compiled``: ``generate`` with ``cache_implementation="static"`` and a ``CompileConfig`` (inductor,
  ``fullgraph``, static shapes, freezing + max-autotune options), transformers' documented route; on a CPU it needs
  ``compile_config._compile_all_devices = True``;
- ``compiled_plain[fp32]``: ppow_trl's loop without a drafter on the compiled runtime (``ppow_trl.serving.runtime``);
- ``compiled_plain[<precision>]`` and ``compiled_speculative[<drafter>@<precision>]`` for each precision of
  ``--precisions`` beyond fp32 (default ``int8``; ``ppow_trl.compiled_runtime.precision``): the target converted, compiled,
  the rule calibrated again on that runtime; lossless is counted against plain decoding at that precision, and
  "= eager" against fp32 eager decoding. The drafter keeps its own precision there, unless ``--drafter-precision
  target``: then each row's drafter runs at its target's precision (``serving_runtime(drafter_precision=...)``),
  which changes its cost per step and its acceptance, not the output;
- ``compiled_speculative[<drafter>]``: the loop with a drafter and the rule ``calibrate_for_serving`` chooses on the
  compiled runtime's measured costs (the main job's drafter, prompt lookup, the hybrid of the two:
  ``ppow_trl.drafters.hybrid``, the looked-up token where the text repeats, the drafter's elsewhere, and with
  ``--eagle3`` an EAGLE-3 head, whose features the compiled target's graphs return); when that rule is K = 0
  the best rule that speculates is also timed, as ``compiled_speculative[<drafter>:best_speculative]``;
- ``llama_cpp_plain[<f16|q8_0>]`` and ``llama_cpp_speculative[<f16|q8_0>]`` (``--skip-llama-cpp`` to leave out):
  llama.cpp's CPU kernels through llama-cpp-python, the strongest plain baseline a CPU user may pick. SmolLM2 is
  exported to GGUF (F16, then llama.cpp's Q8_0 quantizer); the speculative rows add the main job's drafter (exported,
  Q8_0) as llama-cpp-python's draft model at a fixed window of 1, the best of K = 1..3 in
  ``llama_cpp_serving.json``. Each speculative row's reference is the plain row of the same file.

Every row: median ms/token [95% CI], tau, speedups against ``compiled_plain[fp32]`` and ``hf_generate_eager``
(ratio of total times [95% CI]), lossless prompts (tokens equal to compiled plain decoding's) and agreement with
eager plain decoding; each drafter's cost model on the compiled runtime and the compile seconds of this run.
Results are written after each thread count; a rerun skips thread counts already in the JSON with the same
settings and no unfinished run (``--force`` reruns those asked for from scratch and keeps the others). A thread
count's run is resumable: every finished prompt (all arms) and every calibrated rule is kept under
``cache_root()/bench/compiled_serving/`` (``compare_arms(checkpoint=...)``), so the same command run again after a
kill goes on from the prompt it was on, with the same rules; that folder is removed once the thread count's results
are in the JSON.

    python benchmarks/compiled_serving.py                              # 80 MT-bench + 40 code prompts, 1 and 2 threads
    python benchmarks/compiled_serving.py --mtbench 24 --code 12 --threads 1
    python benchmarks/compiled_serving.py --threads 2 --precisions bf16 int8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "compiled_serving.json"
MAX_CACHE_LEN = 512
HF_MAX_CACHE_LEN = 576  # not 512: transformers' compiled call and ours share dynamo's code cache (the same
# Module.__call__); equal cache shapes would let one's graph run on the other's static cache.
CALIBRATION_PROMPTS = 16


def folder_files(folder) -> list:
    """``(name, size, mtime)`` of a drafter folder's files: a retrained drafter saved to the same path differs."""
    return sorted((f.name, f.stat().st_size, int(f.stat().st_mtime)) for f in Path(folder).iterdir() if f.is_file())


def run_settings(args) -> dict:
    """The settings a thread count's results are for: a rerun with the same ones skips it (``main``). The drafters'
    files are part of them: a drafter trained again into the same folder is served again."""
    from ppow_trl.core.windowing import SERVED_MIN_SPEEDUP  # the rules' margin: another one, other rules

    return {"mtbench": args.mtbench, "code": args.code, "max_new_tokens": args.max_new_tokens,
            "max_window": args.max_window, "drafter": str(args.drafter), "precisions": sorted(args.precisions),
            "skip_hf_compiled": args.skip_hf_compiled, "skip_llama_cpp": args.skip_llama_cpp,
            "served_min_speedup": SERVED_MIN_SPEEDUP,
            **({"drafter_precision": args.drafter_precision} if args.drafter_precision != "own" else {}),
            **({"eagle3": str(args.eagle3)} if args.eagle3 else {}),
            "drafter_files": folder_files(args.drafter), **({"eagle3_files": folder_files(args.eagle3)} if args.eagle3 else {})}


def run_state_dir(args, threads: int) -> Path:
    """Where one thread count's unfinished run keeps its rules and finished prompts: keyed by everything that changes
    the arms or the prompts (the settings, the drafter's files, torch's version), so a changed run starts over."""
    import hashlib

    import torch

    from ppow_trl.utils import cache_root

    key = json.dumps([run_settings(args), str(Path(args.drafter).resolve()), torch.__version__], sort_keys=True)
    return cache_root() / "bench" / "compiled_serving" / f"threads{threads}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


def child(args) -> dict:
    import torch
    from transformers import AutoTokenizer
    from transformers.generation import CompileConfig

    import ppow_trl  # noqa: F401
    from ppow_trl.bench.served import compare_arms, format_arms, generate_arm, loop_arm
    from ppow_trl.serving.calibration import held_out_contexts
    from ppow_trl.compiled_runtime.compiled import CompileSettings, compile_cache_dir
    from ppow_trl.core.cost import CostModel
    from ppow_trl.data import build_target_responses, encode_prompt, load_prompts, stop_token_ids
    from ppow_trl.drafting import get_family, load_drafter
    from ppow_trl.drafters.hybrid import hybrid_drafter
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path
    from ppow_trl.compiled_runtime.precision import serving_precision
    from ppow_trl.serving.runtime import serving_runtime
    from ppow_trl.serving.calibration import apply_fitted
    from ppow_trl.serving.rule import calibrate_for_serving
    from ppow_trl.utils import cache_root, set_cpu_threads
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    sys.path.insert(0, str(REPO))
    from benchmarks.llama_cpp_amx_build import cpu_description

    threads = args.threads[0]
    set_cpu_threads(threads)
    state = run_state_dir(args, threads)
    if args.fresh:
        shutil.rmtree(state, ignore_errors=True)
    state.mkdir(parents=True, exist_ok=True)
    target = load_target(smollm2_path()).eval()
    tokenizer = AutoTokenizer.from_pretrained(target.config._name_or_path)
    stop_ids = stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    vocab = len(tokenizer)
    K = args.max_window
    cache_was_empty = not any(compile_cache_dir(CompileSettings()).glob("*"))

    drafters = {"ppow": load_drafter(args.drafter, target=target).eval(),
                "prompt_lookup": get_family("prompt_lookup").build(target, tokenizer).eval()}
    drafters["hybrid"] = hybrid_drafter(drafters["ppow"], target)  # lookup where the text repeats, ppow elsewhere
    if args.eagle3:  # a head reading the target's hidden states: the compiled target's graphs return them
        drafters["eagle3"] = load_drafter(args.eagle3, target=target).eval()
    # Held-out calibration contexts: the target's greedy responses to ShareGPT test prompts (cached on disk).
    calibration = build_target_responses(target, tokenizer, load_prompts("sharegpt-test", CALIBRATION_PROMPTS, seed=1),
                                         max_new_tokens=64, batch_size=8, seed=1,
                                         cache_dir=cache_root() / "responses")
    contexts = held_out_contexts(calibration["prompt_ids"], calibration["response_ids"], 4, 64)

    rules, costs, served_on = {}, {}, {}

    def calibrate(name, drafter, runtime):
        """The served rule and cost model of one arm on ``runtime``: calibrated once per run, then read back, so a
        resumed run serves the rules its first prompts were served with."""
        if runtime.name != "compiled":
            raise SystemExit(f"The compiled runtime is unavailable here ({runtime.fallback}); nothing to compare.")
        saved = state / "rules" / name
        if (saved / "ppow_window_policy.json").is_file() and (saved / "ppow_cost_model.json").is_file():
            policy, cost_model = AdaptiveWindowPolicy.from_pretrained(saved), CostModel.from_pretrained(saved)
            apply_fitted(drafter, policy)  # what the calibration fitted on the drafter (hit rates, lookups alone)
        else:
            with torch.no_grad():
                policy, cost_model, _ = calibrate_for_serving(target, drafter, contexts, max_window=K,
                                                              vocab_size=vocab, pad_id=pad_id, runtime=runtime)
            cost_model.save_pretrained(saved)
            policy.save_pretrained(saved)  # the policy last: its file marks the pair complete
        rules[name], costs[name] = policy, cost_model
        served_on[name] = runtime.describe()  # the graphs' settings and row plan, as served
        print(f"[{name}] {policy.calibration['serving_rule']}", file=sys.stderr, flush=True)
        return policy

    started = time.perf_counter()
    runtimes = {name: serving_runtime(target, drafter, runtime="compiled", max_window=K, max_cache_len=MAX_CACHE_LEN)
                for name, drafter in drafters.items()}
    compile_s = time.perf_counter() - started
    for name, runtime in runtimes.items():
        calibrate(name, drafters[name], runtime)

    compiled_target = runtimes["ppow"].target
    plain = "compiled_plain[fp32]"
    arms = [generate_arm("hf_generate_eager", target, stop_ids, pad_id, "hf_generate_eager")]
    for precision in args.precisions:
        if precision == "fp32":
            continue
        # Fewer bytes per token: the target converted once, every drafter served on it with its own rule.
        converted = serving_precision(target, precision)
        reference = f"compiled_plain[{precision}]"
        for name, drafter in drafters.items():
            if name in ("hybrid", "prompt_lookup"):  # their own config: what this arm's calibration fits stays its own
                drafter = (hybrid_drafter(drafters["ppow"], target) if name == "hybrid"
                           else get_family("prompt_lookup").build(target, tokenizer).eval())
            started = time.perf_counter()
            runtime = serving_runtime(converted, drafter, runtime="compiled", max_window=K,
                                      max_cache_len=MAX_CACHE_LEN, precision=precision,
                                      drafter_precision=precision if args.drafter_precision == "target" else None)
            compile_s += time.perf_counter() - started
            policy = calibrate(f"{name}@{precision}", drafter, runtime)
            if name == "ppow":
                arms.append(loop_arm(reference, runtime.target, drafter, AdaptiveWindowPolicy(max_window=0), stop_ids,
                                     vocab, reference))
            arms.append(loop_arm(f"compiled_speculative[{name}@{precision}]", runtime.target, runtime.drafter, policy,
                                 stop_ids, vocab, reference, {"rule": policy.calibration["serving_rule"]}))
    if not args.skip_hf_compiled:
        config = CompileConfig(fullgraph=True, dynamic=False, mode=None,
                               options={"freezing": True, "max_autotune": True,
                                        "max_autotune_gemm_backends": "CPP,ATEN"})
        config._compile_all_devices = True  # transformers compiles only on accelerators unless told so
        hf_kwargs = {"cache_implementation": "static", "compile_config": config}
        arms.append(generate_arm("hf_generate_compiled", target, stop_ids, pad_id, "hf_generate_compiled",
                                 **hf_kwargs))
    arms.append(loop_arm(plain, compiled_target, drafters["ppow"], AdaptiveWindowPolicy(max_window=0), stop_ids, vocab,
                         plain))
    for name, runtime in runtimes.items():
        policy = rules[name]
        arms.append(loop_arm(f"compiled_speculative[{name}]", runtime.target, runtime.drafter, policy, stop_ids, vocab,
                             plain, {"rule": policy.calibration["serving_rule"]}))
        best = policy.calibration.get("best_speculative_rule")
        if policy.max_window == 0 and best:
            forced = policy.with_window(best["max_window"], best["threshold"], best.get("empty_windows", False))
            forced.guard = best.get("guard")
            arms.append(loop_arm(f"compiled_speculative[{name}:best_speculative]", runtime.target, runtime.drafter,
                                 forced, stop_ids, vocab, plain,
                                 {"rule": f"K = {best['max_window']}, h = {best['threshold']:.2f}, guarded"}))

    llama_cpp = {"skipped": "--skip-llama-cpp"}
    if not args.skip_llama_cpp:
        import atexit
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="ppow_llama_cpp_"))  # GGUF files (0.7 GB): removed when this run ends
        atexit.register(shutil.rmtree, work, True)
        llama_arms, llama_cpp = llama_cpp_arms(target, drafters["ppow"], stop_ids, threads, work)
        arms += llama_arms

    hf_compile_s = None
    if not args.skip_hf_compiled:
        # transformers' compiled generate: compile its decode graph once over a static cache of HF_MAX_CACHE_LEN
        # positions (a first call that long; later calls reuse the cache), outside the timed runs.
        long_prompt = torch.randint(100, 40000, (1, HF_MAX_CACHE_LEN - 16), generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        target.generate(long_prompt, attention_mask=torch.ones_like(long_prompt), max_new_tokens=16, min_new_tokens=16,
                        do_sample=False, pad_token_id=pad_id, **hf_kwargs)
        hf_compile_s = time.perf_counter() - start

    report = {"cpu": cpu_description(), "torch": torch.__version__, "threads": threads, "runs": {},
              "max_new_tokens": args.max_new_tokens, "drafter": str(args.drafter),
              "compile_s": {"ppow_trl_runtime": round(compile_s, 1), "hf_generate_compiled": hf_compile_s and round(hf_compile_s, 1),
                            "inductor_cache": "empty (cold)" if cache_was_empty else "filled (warm)"},
              "cost_models": {name: {"runtime": c.runtime, "t_d/t_t": round(c.drafter_cost, 4),
                                     "t_v(L)/t_t": [round(v, 3) for v in c.verify_cost], "t_t_ms": round(1000 * c.raw_seconds["target_step"], 2),
                                     "loop_overhead (o_0, o_r, o_d)": [round(c.plain_overhead, 4), round(c.round_overhead, 4),
                                                                       round(c.drafted_token_overhead, 4)]}
                              for name, c in costs.items()},
              "rules": {name: p.calibration["serving_rule"] for name, p in rules.items()},
              "served_rules": {name: {"max_window": p.max_window, "threshold": p.threshold} for name, p in rules.items()},
              "runtimes": served_on,
              "llama_cpp": llama_cpp,
              "run_state": str(state)}
    sets = {"mtbench": args.mtbench, "code": args.code}
    for set_name, count in sets.items():
        if not count:
            continue
        # The first `count` prompts of the set that fit the static cache (prompt + new tokens + K), in the set's
        # order; the ones passed over are counted.
        ids, fitting = [], []
        for row in load_prompts(set_name, num_samples=None):
            ids.append(torch.tensor([encode_prompt(tokenizer, row["messages"])]))
            if ids[-1].shape[1] + args.max_new_tokens + K + 1 <= MAX_CACHE_LEN:
                fitting.append(ids[-1])
            if len(fitting) == count:
                break
        result = compare_arms(arms, fitting, max_new_tokens=args.max_new_tokens,
                              baselines=[plain, "hf_generate_eager"], eager_reference="hf_generate_eager",
                              checkpoint=state / f"{set_name}.jsonl")
        report["runs"][set_name] = {"prompts": len(fitting), "skipped_too_long": len(ids) - len(fitting),
                                    "arms": result["arms"], "table": format_arms(result["arms"], [plain, "hf_generate_eager"])}
        print("\n".join(report["runs"][set_name]["table"]), file=sys.stderr, flush=True)
    return report


def llama_cpp_arms(target, drafter, stop_ids, threads: int, work: Path) -> tuple[list, dict]:
    """The llama.cpp rows (module docstring) and what was built for them; ``([], {"skipped": why})`` when
    llama-cpp-python is missing or refuses a file on this CPU (``ppow_trl.interop.llama_cpp_draft.load_llama``)."""
    from ppow_trl.bench.served import Arm
    from ppow_trl.interop.gguf_export import export_gguf
    from ppow_trl.interop.llama_cpp_draft import LlamaCppDrafter, load_llama, quantize_gguf
    from ppow_trl.offline import smollm2_gguf_path
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    window = 1
    stops = set(stop_ids)

    def arm(label, llama, reference, draft=None):
        def run(ids, max_new_tokens):
            if draft is not None:
                draft.reset_stats()
            tokens = []
            for token in llama.generate(ids[0].tolist(), temp=0.0, top_k=1, reset=True):
                tokens.append(int(token))
                if token in stops or len(tokens) == max_new_tokens:
                    break
            # Target forwards that verified: one per drafting round (the last round is never scored: + 1).
            return tokens, len(tokens) if draft is None else len(draft.rounds) + 1

        return Arm(label, run, reference, {"gguf": label.split("[")[1].rstrip("]"), "draft_window": window
                                           if draft is not None else 0})

    try:
        started = time.perf_counter()
        files = {"f16": export_gguf(target, work / "target-f16.gguf", smollm2_gguf_path(), dtype="f16")}
        files["q8_0"] = quantize_gguf(files["f16"], work / "target-q8_0.gguf", "q8_0")
        reduced = getattr(drafter.config, "draft_vocab_size", None) is not None
        drafter_file = quantize_gguf(export_gguf(drafter, work / "drafter-f32.gguf", smollm2_gguf_path(),
                                                 expand_reduced_head=reduced), work / "drafter-q8_0.gguf", "q8_0")
    except (ImportError, RuntimeError, ValueError) as error:  # no llama-cpp-python (gguf), or a failed export
        print(f"llama.cpp rows skipped: {error}", file=sys.stderr, flush=True)
        return [], {"skipped": str(error)}
    arms, info = [], {"export_s": round(time.perf_counter() - started, 1), "draft_window": window,
                      "file_mb": {name: round(path.stat().st_size / 2**20, 1) for name, path in
                                  {**files, "drafter_q8_0": drafter_file}.items()}}
    for precision, path in files.items():
        plain = f"llama_cpp_plain[{precision}]"
        pair = []
        try:  # load_llama refuses quantized files where llama.cpp's AMX backend is known to crash
            pair.append(arm(plain, load_llama(path, n_threads=threads), plain))
            draft = LlamaCppDrafter(drafter_file, AdaptiveWindowPolicy(max_window=window), n_threads=threads)
            pair.append(arm(f"llama_cpp_speculative[{precision}]", load_llama(path, n_threads=threads,
                                                                              draft_model=draft), plain, draft))
        except (RuntimeError, ValueError) as error:
            print(f"llama.cpp {precision} rows skipped: {error}", file=sys.stderr, flush=True)
            info.setdefault("skipped_rows", {})[precision] = str(error)
        arms += pair
    return arms, info


def plot(results: dict, path: Path) -> None:
    """Speedup over transformers' eager generate of every arm, with its 95% CI, one panel per (threads, prompt set)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    figure, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs), 3.6), squeeze=False)
    for axis, (key, run) in zip(axes[0], runs.items()):
        labels = list(run["arms"])
        values = [run["arms"][label]["speedup_vs_hf_generate_eager"] for label in labels]
        low, high = zip(*[run["arms"][label]["speedup_vs_hf_generate_eager_ci95"] for label in labels])
        axis.barh(range(len(labels)), values, xerr=[[v - lo for v, lo in zip(values, low)],
                                                    [hi - v for v, hi in zip(values, high)]], color="tab:blue")
        axis.axvline(1.0, color="grey", linewidth=0.8)
        axis.set_yticks(range(len(labels)), [label.replace("compiled_speculative", "spec") for label in labels],
                        fontsize=7)
        axis.set_title(f"{key} ({run['prompts']} prompts)", fontsize=9)
        axis.set_xlabel("speedup vs hf_generate_eager (fp32)", fontsize=8)
    meta = next(iter(results["meta"].values()))
    figure.suptitle(f"Greedy serving, {meta.get('max_new_tokens', 128)} new tokens, {meta['cpu'].get('model')}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown(results: dict, plot_name: str = "compiled_serving.png") -> str:
    lines = ["# Compiled serving, side by side", "", f"Command: `{results.get('command', '')}`", "",
             f"![speedups]({plot_name})", ""]
    for key, run in results["runs"].items():
        meta = results["meta"][key.split("/")[0]]
        lines += [f"## {key}: {run['prompts']} prompts ({run['skipped_too_long']} longer than the static cache "
                  f"skipped), {meta.get('max_new_tokens', 128)} new tokens, greedy", "",
                  f"CPU {meta['cpu']}; torch {meta['torch']}; {meta['threads']} thread(s); compile seconds "
                  f"{meta['compile_s']}; fp32 unless the row says otherwise.", ""]
        if meta.get("command"):
            lines += [f"Command: `{meta['command']}`", ""]
        lines += run["table"] + [""]
        for name, cost in meta["cost_models"].items():
            lines.append(f"- {name}: {meta['rules'][name]}")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mtbench", type=int, default=80)
    parser.add_argument("--code", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-window", type=int, default=4)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--drafter", default=str(REPO / "outputs" / "ppow-smollm2-offline" / "merged"))
    parser.add_argument("--skip-hf-compiled", action="store_true")
    parser.add_argument("--skip-llama-cpp", action="store_true", help="leave out the llama.cpp rows")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8"], choices=["fp32", "bf16", "int8"],
                        help="target precisions served side by side (fp32 always)")
    parser.add_argument("--drafter-precision", choices=["own", "target"], default="own",
                        help="the drafters of a converted target's rows: as loaded (own) or at the target's precision")
    parser.add_argument("--eagle3", type=Path, default=None,
                        help="an EAGLE-3 head's folder (the eagle3 recipe's merged/): adds its compiled_speculative rows")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fresh", action="store_true", help=argparse.SUPPRESS)  # --force: forget a killed run
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if not (Path(args.drafter) / "config.json").is_file():
        raise SystemExit(f"No drafter at {args.drafter}: run the main job first (README), or pass --drafter FOLDER.")
    if args.eagle3 and not (args.eagle3 / "config.json").is_file():
        raise SystemExit(f"No EAGLE-3 head at {args.eagle3}: train one (accelerate launch recipes/ppow_llama.py "
                         "--config recipes/configs/offline_smollm2_eagle3.yaml) and pass its merged/ folder.")
    # --force reruns the thread counts asked for and keeps the others' results.
    results = json.loads(args.out.read_text()) if args.out.is_file() else {"runs": {}, "meta": {}}
    results["command"] = "python benchmarks/compiled_serving.py " + " ".join(sys.argv[1:])
    settings = run_settings(args)
    for threads in args.threads:
        key = f"threads{threads}"
        unfinished = run_state_dir(args, threads).is_dir()  # a run of these settings that was stopped: go on with it
        if not args.force and not unfinished and results["meta"].get(key, {}).get("settings") == settings:
            print(f"{key}: already in {args.out} with these settings (--force to rerun)")
            continue
        command = [sys.executable, __file__, "--child", "--threads", str(threads), "--mtbench", str(args.mtbench),
                   "--code", str(args.code), "--max-new-tokens", str(args.max_new_tokens), "--max-window",
                   str(args.max_window), "--drafter", args.drafter] + (["--skip-hf-compiled"] if args.skip_hf_compiled else []) + (
                      ["--skip-llama-cpp"] if args.skip_llama_cpp else []) + [
                      "--precisions", *args.precisions, "--drafter-precision", args.drafter_precision] + (
                      ["--fresh"] if args.force else []) + (["--eagle3", str(args.eagle3)] if args.eagle3 else [])
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO)
        if done.returncode:
            raise SystemExit(f"{key} failed (exit {done.returncode}); see the log above.")
        report = json.loads(done.stdout.strip().splitlines()[-1])
        results["runs"] = {k: v for k, v in results["runs"].items() if not k.startswith(key + "/")}
        for set_name, run in report.pop("runs").items():
            results["runs"][f"{key}/{set_name}"] = run
        report["command"] = results["command"]  # each thread count's own command (the top-level one is the latest)
        state = report.pop("run_state")
        report["settings"] = settings  # a rerun with the same settings skips this thread count
        results["meta"][key] = report
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(markdown(results, args.out.with_suffix(".png").name))
        plot(results, args.out.with_suffix(".png"))
        shutil.rmtree(state, ignore_errors=True)  # in the JSON now: nothing left to resume
    print(args.out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
