"""Which stack to serve SmolLM2 on a CPU: the Q4_1 target in llama.cpp against our fp32 target in transformers, and
llama.cpp with our drafter as its draft model (batch 1, greedy, one thread each unless --threads).

Side by side, prompt by prompt (MT-bench first turns, chat template), in one process:

- `transformers_fp32`: `target.generate` on the fp32 SmolLM2 (the dequantized Q4_1 weights), our usual baseline;
- `llama_cpp_q4_1`: the shipped `SmolLM2-135M-Instruct.Q4_1.gguf` in llama.cpp (llama-cpp-python's loop), alone;
- `llama_cpp_q4_1+drafter[q8_0,K]`: the same with our drafter (`export_gguf`, then `quantize_gguf` to q8_0, the main
  job's merged drafter by default) as llama-cpp-python's draft model (`LlamaCppDrafter`, fixed K; greedy drafts);
- `llama_cpp_q4_1+drafter[f32,K]`: the f32 file, for what quantizing the drafter buys.

Per arm: median ms per generated token and its ratio to `llama_cpp_q4_1` measured on the same prompts (bootstrap
interval over prompts), tau (tokens per drafting round, mean A + 1), and whether the text equals the plain llama.cpp
text. Also the llama.cpp cost model (target `t_v(L)/t_t` with the all-position logits verification needs, and
`t_d/t_t` of each drafter file), the batch-vs-sequential logit difference of the Q4_1 target (why speculative text
can differ from plain text in llama.cpp), and, with `--cli-dir`, llama.cpp's own `llama-speculative-simple` and
`llama-server` run with the target and our drafter (they refuse incompatible draft vocabularies), parsed from their
log and reply; `--programs-only` reruns just those and updates the JSON.

    python benchmarks/llama_cpp_serving.py                                   # ~10 min on one core
    python benchmarks/llama_cpp_serving.py --cli-dir ~/.cache/ppow_trl/llama.cpp/build/bin
    python benchmarks/llama_cpp_serving.py --num-prompts 2 --max-new-tokens 16 --out /tmp/llama_cpp.json   # a smoke run

llama.cpp's programs are not part of llama-cpp-python; build them from its source distribution (the same llama.cpp):
`pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`, unpack, then
`cmake -S llama_cpp_python-0.3.36/vendor/llama.cpp -B build -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON &&
cmake --build build -j 2 --target llama-speculative-simple llama-server` (about 12 min on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer

import ppow_trl  # noqa: F401  (registers the reduced-vocabulary drafter)
from ppow_trl.bench.report import machine_info
from ppow_trl.data import load_prompts
from ppow_trl.drafting import load_drafter
from ppow_trl.interop.gguf_export import expanded_head_agreement, export_gguf
from ppow_trl.interop.llama_cpp_draft import LlamaCppDrafter, load_llama, mean_accepted_length, pairing_problems, quantize_gguf
from ppow_trl.offline import smollm2_gguf_path, smollm2_path
from ppow_trl.utils import set_cpu_threads
from ppow_trl.core.windowing import AdaptiveWindowPolicy

sys.path.insert(0, str(Path(__file__).parent))
from speedup import bootstrap_median  # noqa: E402

BASELINE = "llama_cpp_q4_1"


def chat_ids(tokenizer, messages) -> list[int]:
    return tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)).input_ids


def llama_greedy(llama, ids, max_new_tokens: int, eos: int):
    """Greedy tokens from llama-cpp-python's loop, stopped after EOS or ``max_new_tokens``; and the seconds until the
    first one (the prompt's forward)."""
    out, start, first = [], time.perf_counter(), None
    for token in llama.generate(ids, temp=0.0, top_k=1, reset=True):
        first = first or time.perf_counter() - start
        out.append(int(token))
        if token == eos or len(out) == max_new_tokens:
            break
    return out, first


class _FirstTokenClock(BaseStreamer):
    """Records when ``generate`` emits its first new token (its first ``put`` is the prompt)."""

    def __init__(self):
        self.start, self.calls, self.first = time.perf_counter(), 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:
            self.first = time.perf_counter() - self.start

    def end(self):
        pass


def hf_greedy(model, ids, max_new_tokens: int, eos: int):
    clock = _FirstTokenClock()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                             streamer=clock)
    return out[0, len(ids):].tolist(), clock.first


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def forward_ms(llama, ids, length: int, repeats: int) -> float:
    """Median ms of one llama.cpp forward of ``length`` tokens after ``ids`` (the KV cache rolled back each time)."""
    llama.reset()
    llama.eval(ids)
    committed = llama.n_tokens
    times = []
    for _ in range(repeats):
        llama.n_tokens = committed  # eval removes the KV entries from n_tokens on
        times.append(timed(lambda: llama.eval(ids[1 : 1 + length]))[1])
    return 1000 * statistics.median(times)


def cost_model(files: dict, ids, max_length: int, repeats: int, threads: int) -> dict:
    """llama.cpp's costs on this machine: the target's t_v(L)/t_t with all-position logits (what verification
    computes), and each drafter's one-token forward over the target's (t_d/t_t)."""
    target = load_llama(files["target"], n_threads=threads, logits_all=True)
    plain = load_llama(files["target"], n_threads=threads)
    t_t = forward_ms(plain, ids, 1, repeats)
    result = {"t_t_ms": t_t, "t_v_over_t_t": {}, "t_d_over_t_t": {}}
    for length in range(1, max_length + 1):
        result["t_v_over_t_t"][str(length)] = forward_ms(target, ids, length, repeats) / t_t
    for name, path in files.items():
        if name.startswith("drafter"):
            result["t_d_over_t_t"][name] = forward_ms(load_llama(path, n_threads=threads), ids, 1, repeats) / t_t
    return result


def batch_invariance(path, ids, continuation, threads: int) -> float:
    """Max |logit difference| between scoring ``continuation`` one token at a time and in one batch (llama.cpp)."""
    llama = load_llama(path, n_threads=threads, logits_all=True)
    llama.eval(ids)
    for token in continuation:
        llama.eval([token])
    sequential = np.array(llama.scores[len(ids) : len(ids) + len(continuation)])
    llama.reset()
    llama.eval(ids + continuation)
    batched = np.array(llama.scores[len(ids) : len(ids) + len(continuation)])
    return float(np.abs(sequential - batched).max())


def run_cli(cli_dir: Path, files: dict, prompt: str, max_new_tokens: int, window: int, threads: int) -> dict:
    """llama.cpp's ``llama-speculative-simple`` with the target and our q8_0 drafter; its statistics."""
    command = [str(cli_dir / "llama-speculative-simple"), "-m", str(files["target"]), "-md", str(files["drafter_q8_0"]),
               "--spec-type", "draft-simple",
               "-p", prompt, "-n", str(max_new_tokens), "--spec-draft-n-max", str(window), "--spec-draft-n-min", "0",
               "--temp", "0", "-t", str(threads), "-td", str(threads), "-c", "2048", "--seed", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    stats = {key: float(value) for key, value in re.findall(r"(n_drafted|n_accept|n_predict)\s*=\s*([\d.]+)", log)}
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    result = {"command": " ".join(command[:1] + [c if " " not in c else repr(c) for c in command[1:]]),
              "returncode": done.returncode, **stats}
    if speed:
        result["decoded_tokens"], result["decode_seconds"] = int(speed.group(1)), float(speed.group(2))
    if done.returncode != 0 or not stats:
        result["log_tail"] = log[-2000:]
    return result


def run_server(cli_dir: Path, files: dict, prompt: str, max_new_tokens: int, window: int, threads: int,
               port: int = 8089) -> dict:
    """llama.cpp's ``llama-server`` with the target and our q8_0 drafter: one greedy ``/completion`` request, and
    the drafting statistics the server reports (``timings.draft_n`` / ``draft_n_accepted``)."""
    import urllib.request

    command = [str(cli_dir / "llama-server"), "-m", str(files["target"]), "-md", str(files["drafter_q8_0"]),
               "--spec-type", "draft-simple", "--spec-draft-n-max", str(window), "--spec-draft-n-min", "0",
               "-t", str(threads), "-td", str(threads), "-c", "2048", "--port", str(port), "--host", "127.0.0.1"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):  # wait for the model to load
            try:
                if json.loads(urllib.request.urlopen(f"{url}/health", timeout=1).read()).get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        request = urllib.request.Request(f"{url}/completion", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"prompt": prompt, "n_predict": max_new_tokens,
                                                          "temperature": 0, "cache_prompt": False}).encode())
        reply = json.loads(urllib.request.urlopen(request, timeout=600).read())
        timings = reply.get("timings", {})
        return {"command": " ".join(command), "content_start": reply.get("content", "")[:80],
                **{key: timings[key] for key in ("predicted_n", "predicted_per_token_ms", "draft_n",
                                                 "draft_n_accepted") if key in timings}}
    except OSError as error:
        return {"command": " ".join(command), "error": repr(error)}
    finally:
        server.terminate()
        server.wait(timeout=30)


def run_programs(args, files: dict, tokenizer) -> dict:
    """llama.cpp's own programs on the first MT-bench prompt: ``llama-speculative-simple`` at each window, and
    ``llama-server`` at K = 2 where it was built."""
    prompt = tokenizer.apply_chat_template(load_prompts("mtbench", 1)[0]["messages"], add_generation_prompt=True,
                                           tokenize=False)
    results = {"llama_speculative_simple": {
        str(k): run_cli(args.cli_dir, files, prompt, args.max_new_tokens, k, args.threads) for k in args.windows}}
    if (args.cli_dir / "llama-server").is_file():
        results["llama_server"] = run_server(args.cli_dir, files, prompt, args.max_new_tokens, 2, args.threads)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", default="outputs/ppow-smollm2-offline/merged",
                        help="a standalone drafter folder (merged) or a .gguf file")
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15, help="forwards per cost-model entry")
    parser.add_argument("--cli-dir", type=Path, default=None, help="folder of llama.cpp's llama-speculative-simple")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the GGUF files are written (default: temp)")
    parser.add_argument("--programs-only", action="store_true",
                        help="only (re)run llama.cpp's programs (--cli-dir) and update them in an existing --out")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/llama_cpp_serving.json"))
    args = parser.parse_args(argv)

    set_cpu_threads(args.threads)
    work = args.work_dir
    if work is None:  # GGUF files (0.7 GB): a temporary folder, removed when this run ends
        import atexit
        import shutil

        work = Path(tempfile.mkdtemp(prefix="ppow_llama_cpp_"))
        atexit.register(shutil.rmtree, work, True)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    target_hf = AutoModelForCausalLM.from_pretrained(smollm2_path()).eval()
    prompts = [chat_ids(tokenizer, row["messages"]) for row in load_prompts("mtbench", args.num_prompts)]

    # The drafter as GGUF files: f32 (export_gguf; a reduced head is written over the full vocabulary), and q8_0.
    files = {"target": smollm2_gguf_path()}
    drafter_info = {"source": str(args.drafter)}
    if str(args.drafter).endswith(".gguf"):
        files["drafter_f32"] = Path(args.drafter)
    else:
        drafter = load_drafter(args.drafter).eval()
        reduced = getattr(drafter.config, "draft_vocab_size", None) is not None
        files["drafter_f32"] = export_gguf(drafter, work / "drafter-f32.gguf", smollm2_gguf_path(),
                                           expand_reduced_head=reduced)
        if reduced:
            # Where the f32 file's greedy proposal is the drafter's own (its best draft logit above the zeros).
            drafter_info["expanded_head_agreement"] = statistics.mean(
                expanded_head_agreement(drafter, torch.tensor([ids])) for ids in prompts)
        drafter_info["layers"] = drafter.config.get_text_config().num_hidden_layers
    files["drafter_q8_0"] = quantize_gguf(files["drafter_f32"], work / "drafter-q8_0.gguf", "q8_0")
    plain = load_llama(files["target"], n_threads=args.threads)
    drafter_info["pairing_problems"] = {name: pairing_problems(plain, load_llama(path)) for name, path in files.items()
                                        if name.startswith("drafter")}
    drafter_info["file_mb"] = {name: round(Path(path).stat().st_size / 2**20, 1) for name, path in files.items()}

    results = {"machine": machine_info(torch.device("cpu")), "precision": {
        "transformers_fp32": "fp32 weights (the Q4_1 file dequantized), fp32 compute",
        "llama_cpp_q4_1": "Q4_1 weights (token_embd Q8_0 / output tied), llama.cpp CPU kernels, f16 KV cache",
        "drafter": "q8_0 (llama.cpp's quantizer on our f32 export) and f32, f16 KV cache"},
        "threads": args.threads, "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "drafter": drafter_info, "command": "python benchmarks/llama_cpp_serving.py " + " ".join(argv or sys.argv[1:])}

    if args.programs_only:
        if not args.cli_dir or not args.out.is_file():
            parser.error("--programs-only needs --cli-dir and an existing --out to update")
        results = json.loads(args.out.read_text())
        results.update(run_programs(args, files, tokenizer))
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps({k: results[k] for k in ("llama_speculative_simple", "llama_server") if k in results}, indent=1))
        return 0

    print("cost model ...", flush=True)
    results["llama_cpp_cost_model"] = cost_model(files, prompts[0], max(args.windows) + 1, args.repeats, args.threads)
    results["llama_cpp_cost_model"]["transformers_fp32_t_t_ms"] = hf_forward_ms(target_hf, prompts[0], args.repeats)

    arms = {"transformers_fp32": lambda ids: hf_greedy(target_hf, ids, args.max_new_tokens, eos),
            BASELINE: lambda ids: llama_greedy(plain, ids, args.max_new_tokens, eos)}
    drafters = {}
    for window in args.windows:
        for kind in ("q8_0", "f32") if window == 2 else ("q8_0",):
            name = f"{BASELINE}+drafter[{kind},K={window}]"
            drafters[name] = LlamaCppDrafter(files[f"drafter_{kind}"], AdaptiveWindowPolicy(max_window=window),
                                             n_threads=args.threads)
            llama = load_llama(files["target"], n_threads=args.threads, draft_model=drafters[name])
            arms[name] = (lambda llama: lambda ids: llama_greedy(llama, ids, args.max_new_tokens, eos))(llama)
    per_prompt = {name: [] for name in arms}
    for number, ids in enumerate(prompts):
        for name, arm in arms.items():  # side by side, one prompt at a time
            if name in drafters:
                drafters[name].reset_stats()
            (tokens, first), seconds = timed(lambda: arm(ids))
            record = {"tokens": tokens, "seconds": seconds, "first_token_seconds": first}
            if name in drafters:
                record["rounds"] = list(drafters[name].rounds)
            per_prompt[name].append(record)
        print(f"prompt {number + 1}/{len(prompts)}", flush=True)

    results["arms"] = summarize(per_prompt)
    results["batch_invariance_q4_1_max_abs_logit_diff"] = batch_invariance(
        files["target"], prompts[0], per_prompt[BASELINE][0]["tokens"][:24], args.threads)
    if args.cli_dir:
        results.update(run_programs(args, files, tokenizer))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({name: {k: v for k, v in arm.items() if k != "per_prompt"} for name, arm in results["arms"].items()},
                     indent=1))
    print(f"wrote {args.out}")
    return 0


def hf_forward_ms(model, ids, repeats: int) -> float:
    """Median ms of one transformers decode step (one token after ``ids``, with the prompt's KV cache)."""
    with torch.no_grad():
        prefix = model(torch.tensor([ids[:-1]]), use_cache=True)
        times = []
        for _ in range(repeats):
            cache = copy.deepcopy(prefix.past_key_values)
            times.append(timed(lambda: model(torch.tensor([ids[-1:]]), past_key_values=cache, use_cache=True))[1])
    return 1000 * statistics.median(times)


def decode_ms_per_token(record: dict) -> float:
    """ms per token after the first one: ``(total - first) / (n - 1)``."""
    return 1000 * (record["seconds"] - record["first_token_seconds"]) / max(len(record["tokens"]) - 1, 1)


def summarize(per_prompt: dict) -> dict:
    """Per arm: decoding ms per token after the first (the prompt's forward excluded; median over prompts), the
    per-prompt ratio of the plain llama.cpp arm's to it (>1: faster than llama.cpp alone; median and bootstrap 95%
    interval), tau, and how many texts equal the plain llama.cpp text."""
    base = per_prompt[BASELINE]
    base_ms = [decode_ms_per_token(r) for r in base]
    summary = {}
    for name, records in per_prompt.items():
        ms_per_token = [decode_ms_per_token(r) for r in records]
        ratios = [b / m for b, m in zip(base_ms, ms_per_token)]
        rounds = [pair for r in records for pair in r.get("rounds", [])]
        same = [r["tokens"] == b["tokens"] for r, b in zip(records, base)]
        summary[name] = {"decode_ms_per_token_median": statistics.median(ms_per_token),
                         "first_token_ms_median": 1000 * statistics.median(r["first_token_seconds"] for r in records),
                         "speed_vs_llama_cpp_q4_1_median": statistics.median(ratios),
                         "speed_vs_llama_cpp_q4_1_ci95": bootstrap_median(ratios),
                         "tokens": sum(len(r["tokens"]) for r in records),
                         "same_text_as_llama_cpp_q4_1": f"{sum(same)}/{len(same)}"}
        if rounds:
            summary[name]["tau"] = mean_accepted_length(rounds)
            summary[name]["rounds"] = len(rounds)
        summary[name]["per_prompt"] = [
            {"new_tokens": len(r["tokens"]), "seconds": round(r["seconds"], 4),
             "first_token_seconds": round(r["first_token_seconds"], 4),
             **({"tau": mean_accepted_length(r["rounds"])} if r.get("rounds") else {})} for r in records]
    return summary


if __name__ == "__main__":
    raise SystemExit(main())
