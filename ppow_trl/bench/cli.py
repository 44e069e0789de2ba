"""``python -m ppow_trl.bench``: parse and check the arguments, load the target, drafters and prompts, calibrate
the drafters' cost models, run ``run_benchmark`` and write its outputs."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from ..core.cost import CostModel, calibrate_cost_model
from ..data import PROMPT_SOURCES, encode_prompt, load_prompts
from ..drafting import detect_family, family_names, get_family
from ..models import check_compatibility, load_target, make_drafter
from ..utils import set_cpu_threads
from ..core.windowing import WINDOW_POLICY_FILE, AdaptiveWindowPolicy
from . import __doc__ as PROTOCOL  # the package docstring: the --help text
from .report import format_markdown, write_outputs
from .runners import DEFAULT_METHODS, METHODS, MODES, BenchDrafter
from .timing import run_benchmark


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ppow_trl.bench", description=PROTOCOL,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target path or Hub id (default: offline SmolLM2-135M-Instruct)")
    parser.add_argument("--quantization", choices=("4bit", "8bit"), default=None, help="bitsandbytes target")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--drafter", action="append", default=[], metavar="PATH",
                        help="drafter folder (repeatable); its ppow_window_policy.json gives K and h")
    parser.add_argument("--drafter-layers", type=int, action="append", default=[], metavar="N",
                        help="truncated drafter: the target's first N layers (repeatable; default 2 if no --drafter)")
    parser.add_argument("--family", action="append", default=[], metavar="NAME",
                        help="a drafter its family builds from the target with no training (repeatable), e.g. "
                        "prompt_lookup; families: " + ", ".join(family_names()))
    parser.add_argument("--max-window", type=int, default=6, help="K for drafters without a saved policy")
    parser.add_argument("--threshold", type=float, default=0.4, help="h for drafters without a saved policy")
    parser.add_argument("--prompts", default="mtbench", help=f"one of {PROMPT_SOURCES} or a .jsonl file")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["greedy", "sample"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS))
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--cost-repeats", type=int, default=5,
                        help="repeats of calibrate_cost_model for drafters without a saved cost model (0: skip)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="outputs/bench/bench", help="output prefix: writes .json, .md, .png")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def parse_args(argv=None):
    """Parse and check the arguments (before any model is loaded): errors exit with a usage message."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens <= 0:
        parser.error(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}.")
    if args.num_prompts <= 0:
        parser.error(f"--num-prompts must be a positive integer, got {args.num_prompts}.")
    if args.prompts not in PROMPT_SOURCES and not Path(args.prompts).is_file():
        parser.error(f"--prompts {args.prompts}: no such file. Use one of {PROMPT_SOURCES} or a path to a .jsonl file.")
    for path in args.drafter:
        if not Path(path).is_dir():
            parser.error(f"--drafter {path}: no such folder (a drafter saved by ppow_trl / save_pretrained).")
    if any(n <= 0 for n in args.drafter_layers):
        parser.error("--drafter-layers must be positive.")
    for name in args.family:
        if name not in family_names():
            parser.error(f"--family {name}: not a registered drafter family ({family_names()}).")
    try:
        AdaptiveWindowPolicy(max_window=args.max_window, threshold=args.threshold)
    except ValueError as error:
        parser.error(str(error))
    if not args.drafter and not args.drafter_layers and not args.family:
        args.drafter_layers = [2]
    return args


def load_bench_prompts(source: str, num_prompts: int, seed: int = 0):
    """Prompt rows: MT-bench ordered one category after another (first 8 cover the 8 categories), else
    ``load_prompts(source, num_prompts, seed)``."""
    if source == "mtbench":
        prompts = load_prompts("mtbench")
        order = sorted(range(len(prompts)), key=lambda i: (i % 10, i))
        return prompts.select(order[:num_prompts])
    return load_prompts(source, num_samples=num_prompts, seed=seed)


def _load_drafters(args, target, tokenizer, dtype) -> list[BenchDrafter]:
    drafters = []
    default_policy = AdaptiveWindowPolicy(max_window=args.max_window, threshold=args.threshold)
    for path in args.drafter:
        device = next(target.parameters()).device
        family, layout = detect_family(path)  # any family, any layout it imports
        model = family.load(path, target=target).to(device=device, dtype=dtype).eval().requires_grad_(False)
        print(f"[bench] {path}: {type(model).__name__}, {family.description} ({layout} layout)", file=sys.stderr)
        has_policy = (Path(path) / WINDOW_POLICY_FILE).is_file()
        policy = AdaptiveWindowPolicy.from_pretrained(path) if has_policy else default_policy
        if not has_policy:
            print(f"[bench] {path} has no {WINDOW_POLICY_FILE}: using K={policy.max_window}, h={policy.threshold}",
                  file=sys.stderr)
        cost = CostModel.from_pretrained(path) if (Path(path) / "ppow_cost_model.json").is_file() else None
        drafters.append(BenchDrafter(Path(path).name, model, policy, cost, source=str(path)))
    source = target
    if args.drafter_layers and getattr(target, "hf_quantizer", None) is not None:
        source = load_target(args.target_path, torch_dtype=dtype).to(next(target.parameters()).device)
    for layers in args.drafter_layers:
        model = make_drafter(source, num_layers=layers).requires_grad_(False)
        drafters.append(BenchDrafter(f"layers{layers}", model, default_policy,
                                     source=f"first {layers} layers of the target (untrained)"))
    for name in args.family:
        family = get_family(name)
        model = family.build(target, tokenizer).eval().requires_grad_(False)
        drafters.append(BenchDrafter(name, model, default_policy, source=family.describe(model)))
    for drafter in drafters:
        check_compatibility(target, drafter.model, tokenizer)
    return drafters


def _calibrate(drafters, target, context_ids, repeats: int) -> None:
    for drafter in drafters:
        if drafter.cost_model is None and repeats > 0:
            drafter.cost_model = calibrate_cost_model(target, drafter.model, drafter.policy.max_window,
                                                      context_ids=context_ids, repeats=repeats, warmup=1)


def main(argv=None, *, target=None, tokenizer=None, drafters: list[BenchDrafter] | None = None) -> dict:
    """The CLI. ``target``/``tokenizer``/``drafters`` may be given already built (tests); then ``--target`` and
    ``--drafter*`` are ignored (no drafters given: they are built from ``--drafter-layers``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    threads = set_cpu_threads()
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # generate's "flag ignored" warnings would drown the progress bar
    try:
        return _main(args, argv, threads, target, tokenizer, drafters)
    finally:
        transformers.logging.set_verbosity(verbosity)


def _main(args, argv, threads, target, tokenizer, drafters) -> dict:
    import transformers

    dtype = getattr(torch, args.dtype)
    if target is None or tokenizer is None:
        from ..offline import smollm2_path

        args.target_path = args.target or str(smollm2_path())
    else:
        args.target_path = args.target or getattr(target, "name_or_path", "") or type(target).__name__
    if target is None:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        target = load_target(args.target_path, quantization=args.quantization, torch_dtype=dtype,
                             device_map=device if args.quantization else None)
        if not args.quantization:
            target = target.to(device)
    if tokenizer is None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.target_path)
    prompts = load_bench_prompts(args.prompts, args.num_prompts, args.seed)
    if drafters is None:
        drafters = _load_drafters(args, target, tokenizer, dtype)
    device = next(target.parameters()).device
    first = torch.tensor([encode_prompt(tokenizer, prompts[0]["messages"])], device=device)
    _calibrate(drafters, target, first, args.cost_repeats)
    precision = str(target.dtype).removeprefix("torch.") + (f", {args.quantization}" if args.quantization else "")
    info = {"command": "python -m ppow_trl.bench " + shlex.join(argv), "target": args.target_path,
            "precision": precision, "prompts": args.prompts, "threads": threads}
    report = run_benchmark(target, tokenizer, drafters, prompts, methods=args.methods, modes=args.modes,
                           max_new_tokens=args.max_new_tokens, warmup_tokens=args.warmup_tokens, seed=args.seed,
                           progress=not args.no_progress, info=info)
    paths = write_outputs(report, args.output)
    print(format_markdown(report))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return report

