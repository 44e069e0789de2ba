"""GPU check: the `cuda` tests and the cost profile of Llama-3.1-8B / Llama-3.2-1B-shaped models on one GPU.

One command, no Hub access (random weights built locally from `LlamaConfig`; timing does not depend on
the values), under 8 minutes on one H200:

    python benchmarks/gpu_check.py                                   # writes benchmarks/results/gpu_cost_profile.json
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu_tiny.json   # same code, tiny shapes, CPU, seconds

It (a) runs `python -m pytest -q -m cuda tests/test_cuda.py` in a subprocess and records the counts;
(b) measures, for a bf16 target and for the same target in 4-bit (bitsandbytes NF4, bf16 compute), with
a bf16 1B-shaped drafter:

- the cost model, with `ppow_trl.calibrate_cost_model` (its interface fits: a KV cache of
  `--cache-length` tokens, one forward per workload cropped back after each, CUDA-synchronised,
  warm-up, round-robin medians): `t_t` (one-token target step), `t_v(L) / t_t` for L = 0..`--max-window`
  (a forward over L + 1 tokens), `t_d / t_t` (one-token drafter step);
- the overhead of HF's assisted loop per round: wall time of
  `target.generate(assistant_model=drafter, do_sample=False, max_new_tokens=N)` with a constant
  `num_assistant_tokens` (schedule "constant", confidence threshold 0) minus the time spent inside the two
  models' forwards (forward pre-/post-hooks, synchronised), divided by the rounds (= target forwards);
  the same for plain `target.generate` per step, for comparison;

and (c) writes it all, with versions, GPU name, dtypes, cache length, repeats and the command, to JSON.

The 4-bit target: transformers quantizes with bitsandbytes while it loads weights in `from_pretrained`;
`from_config` builds full-precision modules and has no quantizer step. So the random bf16 target is saved
to a temporary folder (safetensors, ~16 GB for the 8B shape) and reloaded with
`ppow_trl.load_target(folder, quantization="4bit")`, which also exercises load_target's CUDA defaults
(bf16 compute, NF4, `device_map={"": local rank}`).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere: use this checkout's ppow_trl
    sys.path.insert(0, str(REPO))

from ppow_trl.core.cost import calibrate_cost_model  # noqa: E402
from ppow_trl.models import load_target, model_device  # noqa: E402
from ppow_trl.utils import set_cpu_threads  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_cost_profile.json"
CUDA_TESTS = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "tests/test_cuda.py"]

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}
# meta-llama/Llama-3.1-8B and Llama-3.2-1B shapes (config.json of each)
SHAPES = {
    "target": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                   intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                   max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE),
    "drafter": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                    max_position_embeddings=131072, rope_parameters={**LLAMA3_ROPE, "factor": 32.0}),
}
TINY_SHAPES = {
    "target": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=512, tie_word_embeddings=False,
                   max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE),
    "drafter": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=512, tie_word_embeddings=True,
                    max_position_embeddings=131072, rope_parameters=LLAMA3_ROPE),
}


DEFAULTS = dict(cache_length=512, repeats=30, warmup=5, new_tokens=64, generate_repeats=3)
TINY_DEFAULTS = dict(cache_length=128, repeats=10, warmup=2, new_tokens=24, generate_repeats=2)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes on CPU in fp32 (no 4-bit, no cuda tests): checks the script itself")
    parser.add_argument("--out", default=None,
                        help=f"JSON to write (default: {DEFAULT_OUT.relative_to(REPO)}; with --tiny a temp file)")
    # None: the GPU default, or the smaller --tiny one (TINY_DEFAULTS)
    parser.add_argument("--cache-length", type=int, default=None, help="KV cache (context) length (512)")
    parser.add_argument("--max-window", type=int, default=8, help="t_v(L) for L = 0..max-window")
    parser.add_argument("--repeats", type=int, default=None, help="timed forwards per workload, medians (30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed forwards per workload first (5)")
    parser.add_argument("--assistant-tokens", type=int, default=6, help="constant num_assistant_tokens (K)")
    parser.add_argument("--new-tokens", type=int, default=None, help="max_new_tokens of each generate call (64)")
    parser.add_argument("--generate-repeats", type=int, default=None, help="timed generate calls after a warm-up (3)")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the cuda tests")
    parser.add_argument("--no-4bit", action="store_true", help="only the bf16 target")
    parser.add_argument("--tmp-dir", default=None, help="where the bf16 target is saved for 4-bit reloading")
    args = parser.parse_args(argv)
    for name, value in (TINY_DEFAULTS if args.tiny else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ------------------------------------------------------------------------------------------ models


def build_llama(shape: dict, dtype: torch.dtype, device: torch.device, seed: int):
    """A random-weight `LlamaForCausalLM` of `shape`, built directly on `device` in `dtype`; no EOS, so
    every generate call runs its full `max_new_tokens`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# ------------------------------------------------------------------------------------------ timing


class ForwardTimer:
    """Seconds spent inside each model's forward (pre-hook to post-hook, synchronised) and its call count."""

    def __init__(self, models: dict, synchronize):
        self.synchronize = synchronize
        self.handles = []
        self.reset()
        for name, model in models.items():
            self.handles.append(model.register_forward_pre_hook(lambda *_, name=name: self._start(name)))
            self.handles.append(model.register_forward_hook(lambda *_, name=name: self._stop(name)))

    def reset(self):
        self.seconds = {}
        self.calls = {}
        self._started = {}

    def _start(self, name):
        self.synchronize()
        self._started[name] = time.perf_counter()

    def _stop(self, name):
        self.synchronize()
        elapsed = time.perf_counter() - self._started.pop(name)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        self.calls[name] = self.calls.get(name, 0) + 1

    def close(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []


def generate_overhead(target, drafter, prompt, *, assistant_tokens, new_tokens, repeats, synchronize) -> dict:
    """Per-round overhead of HF's assisted loop (and per-step overhead of plain greedy `generate`):
    (wall - time inside the models' forwards) / rounds, the median over `repeats` calls after one warm-up."""
    config = drafter.generation_config
    saved = (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)
    config.num_assistant_tokens = assistant_tokens
    config.num_assistant_tokens_schedule = "constant"  # HF never changes K
    config.assistant_confidence_threshold = 0.0  # no early stop inside a draft: every round drafts K tokens
    mask = torch.ones_like(prompt)
    timer = ForwardTimer({"target": target, "drafter": drafter}, synchronize)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  pad_token_id=0)
    def timed_generate(extra):
        synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.generate(prompt, **kwargs, **extra)
        synchronize()
        return out, time.perf_counter() - start

    result = {}
    try:
        for method, extra in (("assisted", {"assistant_model": drafter}), ("plain", {})):
            runs = []
            for index in range(repeats + 1):
                timer.reset()
                out, wall = timed_generate(extra)
                if index == 0:
                    continue  # warm-up
                inside = sum(timer.seconds.values())
                rounds = timer.calls.get("target", 0)
                runs.append({
                    "wall_s": wall, "forward_s": inside, "target_forwards": rounds,
                    "drafter_forwards": timer.calls.get("drafter", 0),
                    "new_tokens": int(out.shape[1] - prompt.shape[1]),
                    "overhead_per_round_s": (wall - inside) / rounds,
                })
            result[method] = {
                key: statistics.median(run[key] for run in runs)
                for key in ("overhead_per_round_s", "wall_s", "forward_s", "target_forwards", "drafter_forwards",
                            "new_tokens")
            }
            result[method]["runs"] = runs
        timer.close()
        # The hooks synchronise around every forward, which stops CPU work from overlapping GPU kernels;
        # the same calls without hooks show how much that changes the wall time.
        for method, extra in (("assisted", {"assistant_model": drafter}), ("plain", {})):
            walls = [timed_generate(extra)[1] for _ in range(repeats)]
            result[method]["wall_unhooked_s"] = statistics.median(walls)
            result[method]["overhead_per_round_unhooked_s"] = (
                (result[method]["wall_unhooked_s"] - result[method]["forward_s"]) / result[method]["target_forwards"]
            )
    finally:
        timer.close()
        (config.num_assistant_tokens, config.num_assistant_tokens_schedule,
         config.assistant_confidence_threshold) = saved
    return {
        "num_assistant_tokens": assistant_tokens, "schedule": "constant", "assistant_confidence_threshold": 0.0,
        "max_new_tokens": new_tokens, "prompt_tokens": int(prompt.shape[1]), "repeats": repeats, "warmup_calls": 1,
        "definition": "(wall of generate - seconds inside target/drafter forwards, hooks synchronised) / rounds; "
                      "rounds = target forwards (HF's first round also prefills the prompt)",
        **result,
    }


def profile(name, target, drafter, args, synchronize, note="") -> dict:
    """Cost ratios (calibrate_cost_model) and the HF assisted-loop overhead of one target / drafter pair."""
    device = model_device(target)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    cost = calibrate_cost_model(target, drafter, args.max_window, context_length=args.cache_length,
                                repeats=args.repeats, warmup=args.warmup)
    vocab = min(target.get_input_embeddings().num_embeddings, drafter.get_input_embeddings().num_embeddings)
    prompt = torch.randint(0, vocab, (1, args.cache_length), generator=torch.Generator().manual_seed(1)).to(device)
    overhead = generate_overhead(target, drafter, prompt, assistant_tokens=args.assistant_tokens,
                                 new_tokens=args.new_tokens, repeats=args.generate_repeats, synchronize=synchronize)
    t_t = cost.raw_seconds["target_step"]
    overhead["assisted"]["overhead_over_t_t"] = overhead["assisted"]["overhead_per_round_s"] / t_t
    overhead["plain"]["overhead_over_t_t"] = overhead["plain"]["overhead_per_round_s"] / t_t
    entry = {
        "name": name,
        "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
        "target_quantization": _quantization(target),
        "drafter_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
        "attn_implementation": target.config._attn_implementation,
        "t_t_s": t_t,
        "t_d_s": cost.raw_seconds["drafter_step"],
        "t_v_s": cost.raw_seconds["verify"],
        "L": list(range(args.max_window + 1)),
        "t_v_over_t_t": cost.verify_cost,
        "t_d_over_t_t": cost.drafter_cost,
        "assisted_overhead": overhead,
        "calibration": cost.description,
        "seconds": time.perf_counter() - start,
        "note": note,
    }
    if device.type == "cuda":
        entry["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(f"[gpu_check] {name}: t_t {1e3 * t_t:.2f} ms, t_d/t_t {cost.drafter_cost:.3f}, t_v(L)/t_t "
          + " ".join(f"{c:.2f}" for c in cost.verify_cost)
          + f"; HF assisted overhead/round {1e3 * overhead['assisted']['overhead_per_round_s']:.2f} ms "
          f"({overhead['assisted']['overhead_over_t_t']:.2f} t_t), plain generate overhead/step "
          f"{1e3 * overhead['plain']['overhead_per_round_s']:.2f} ms", flush=True)
    return entry


def _quantization(model):
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return None
    config = config if isinstance(config, dict) else config.to_dict()
    keep = ("quant_method", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype")
    return {key: str(config[key]) for key in keep if key in config}


# ------------------------------------------------------------------------------------------ cuda tests


def run_cuda_tests(timeout: int = 300) -> dict:
    """`pytest -q -m cuda tests/test_cuda.py` in a subprocess: return code and pass/fail counts."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(CUDA_TESTS, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        output, returncode = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as error:
        output, returncode = f"timed out after {timeout} s\n{error.stdout or ''}", None
    counts = {kind: 0 for kind in ("passed", "failed", "skipped", "errors", "deselected")}
    lines = [line for line in output.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else ""
    for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", summary):
        counts["errors" if kind.startswith("error") else kind] = int(number)
    result = {"command": "python -m pytest -q -m cuda tests/test_cuda.py", "returncode": returncode,
              **counts, "summary": summary, "seconds": time.perf_counter() - start}
    if returncode != 0:
        result["output_tail"] = output[-4000:]
    print(f"[gpu_check] cuda tests: {summary} (rc {returncode})", flush=True)
    return result


# ------------------------------------------------------------------------------------------ main


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's per-call "flags ignored" warnings
    try:
        return _main(args, argv)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _main(args, argv) -> dict:
    import transformers

    started = time.perf_counter()

    if args.tiny:
        device, dtype, shapes = torch.device("cpu"), torch.float32, TINY_SHAPES
        out = Path(args.out) if args.out else Path(tempfile.gettempdir()) / "ppow_gpu_check_tiny.json"
        set_cpu_threads()
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check needs a CUDA device (torch.cuda.is_available() is False); "
                             "use --tiny to check the script on CPU.")
        device, dtype, shapes = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16, SHAPES
        out = Path(args.out) if args.out else DEFAULT_OUT
    synchronize = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    result = {
        "command": "python benchmarks/gpu_check.py" + ("" if not argv else " " + " ".join(argv)),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "tiny": args.tiny,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "versions": {
            "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "bitsandbytes": _version("bitsandbytes"),
            "platform": platform.platform(),
        },
        "cpu_threads": torch.get_num_threads(),
        "shapes": {role: {k: v for k, v in shape.items()} for role, shape in shapes.items()},
        "weights": "random (LlamaConfig initializer_range 0.02), built locally: timing does not depend on values",
        "dtype": str(dtype).removeprefix("torch."),
        "cache_length": args.cache_length,
        "max_window": args.max_window,
        "repeats": args.repeats,
        "warmup": args.warmup,
    }
    def write():  # after every stage: a failure later (e.g. in the 4-bit reload) keeps what was measured
        result["wall_seconds"] = time.perf_counter() - started
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2, default=str) + "\n")

    if args.tiny or args.skip_tests:
        result["cuda_tests"] = {"skipped": "--tiny" if args.tiny else "--skip-tests"}
    else:
        result["cuda_tests"] = run_cuda_tests()  # before the big models take the GPU
    write()

    target = build_llama(shapes["target"], dtype, device, seed=0)
    drafter = build_llama(shapes["drafter"], dtype, device, seed=1)
    result["profiles"] = [profile(result["dtype"], target, drafter, args, synchronize)]
    write()

    if not args.tiny and not args.no_4bit:
        method = ("random bf16 target saved with save_pretrained to a temp folder and reloaded with "
                  "ppow_trl.load_target(folder, quantization='4bit') (bitsandbytes quantizes while "
                  "from_pretrained loads weights; from_config has no quantizer step)")
        with tempfile.TemporaryDirectory(dir=args.tmp_dir, prefix="ppow_gpu_check_") as folder:
            saving = time.perf_counter()
            target.save_pretrained(folder)
            del target
            torch.cuda.empty_cache()
            quantized = load_target(folder, quantization="4bit")  # CUDA defaults: bf16 compute, NF4, local GPU
            seconds = time.perf_counter() - saving
        quantized.generation_config.eos_token_id = None
        quantized.generation_config.pad_token_id = 0
        result["profiles"].append(profile("4bit-nf4 (bf16 compute)", quantized, drafter, args, synchronize,
                                          note=f"{method}; save + reload took {seconds:.0f} s"))
    write()
    print(f"[gpu_check] wrote {out} ({result['wall_seconds']:.1f} s)", flush=True)
    return result


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
