"""End-to-end demo of the speculative core on the real offline target (SmolLM2-135M-Instruct, fp32, CPU).

    python -m ppow_trl.demo            # ~3-5 minutes on 2 CPU cores; results cached for reruns

It walks the data flow every later piece builds on:
target-regenerated responses -> divergence-aware choice of contexts -> drafter windows ->
one target forward per window -> E[A|y], S(y), R_prox -> calibration of the adaptive window (K, h).
The drafter is the target's first layers with a reduced-vocabulary head and is *untrained*: the demo
shows the pipeline and the measurement protocol, not a speedup (training arrives with PPOWTrainer).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .serving.calibration import calibrate_policy
from .training.contexts import score_sequence
from .core.cost import calibrate_cost_model, overall_speedup, speedup
from .data import build_target_responses, load_mtbench, recover_json_records, sharegpt_json_path
from .models import build_draft_vocab, check_compatibility, draft_vocab_coverage, load_target, make_drafter
from .offline import smollm2_path
from .core.rewards import proximity_reward, window_reward
from .core.rollout import draft_windows, target_window_probs
from .utils import cache_root, set_cpu_threads
from .core.verification import window_prefix_acceptance
from .core.windowing import AdaptiveWindowPolicy, sample_window_starts, window_start_probabilities


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target model path or Hub id (default: offline SmolLM2-135M-Instruct)")
    parser.add_argument("--num-prompts", type=int, default=8, help="MT-bench prompts (first turn), one per category first")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--drafter-layers", type=int, default=4)
    parser.add_argument("--draft-vocab-size", type=int, default=8192, help="0 keeps the full head")
    parser.add_argument("--draft-vocab-records", type=int, default=3000, help="ShareGPT replies counted for the draft vocabulary")
    parser.add_argument("--max-window", type=int, default=6)
    parser.add_argument("--num-contexts", type=int, default=48)
    parser.add_argument("--beta", type=float, default=1.0, help="divergence-aware selection strength (0 = uniform)")
    parser.add_argument("--proximity-weight", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="outputs/demo")
    return parser.parse_args(argv)


def sharegpt_reply_token_ids(tokenizer, num_records: int) -> list[list[int]]:
    """Token ids of the first assistant reply of the first ShareGPT train records (draft-vocabulary counts)."""
    replies = []
    for record in recover_json_records(sharegpt_json_path()):
        turns = record.get("conversations", []) if isinstance(record, dict) else []
        reply = next((t.get("value", "") for t in turns if t.get("from") == "gpt"), "")
        if reply:
            replies.append(reply)
        if len(replies) >= num_records:
            break
    return tokenizer(replies, add_special_tokens=False)["input_ids"]


def one_per_category_first(prompts, count):
    """MT-bench ordered so that the first 8 cover the 8 categories."""
    order = sorted(range(len(prompts)), key=lambda i: (i % 10, i))
    return prompts.select(order[:count])


def main(argv=None):
    args = parse_args(argv)
    threads = set_cpu_threads()
    torch.manual_seed(args.seed)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    clock = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - clock:6.1f}s] {msg}", flush=True)  # noqa: E731

    target_path = args.target or smollm2_path()
    log(f"target: {target_path} (fp32, {threads} torch thread(s))")
    target = load_target(target_path)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_path)

    prompts = one_per_category_first(load_mtbench(), args.num_prompts)
    log(f"regenerating {len(prompts)} MT-bench responses with the target (cached under {cache_root()})")
    data = build_target_responses(
        target, tokenizer, prompts, max_new_tokens=args.max_new_tokens, batch_size=4,
        cache_dir=cache_root() / "responses",
    )
    responses = [torch.tensor(r, dtype=torch.long) for r in data["response_ids"]]
    prompt_ids = [torch.tensor(p, dtype=torch.long) for p in data["prompt_ids"]]
    log(f"{sum(map(len, responses))} target tokens in {len(responses)} responses")

    draft_vocab = None
    coverage = 1.0
    if args.draft_vocab_size:
        counts_from = sharegpt_reply_token_ids(tokenizer, args.draft_vocab_records)
        draft_vocab = build_draft_vocab(counts_from, args.draft_vocab_size, len(tokenizer),
                                        always_include=tokenizer.all_special_ids)
        coverage = draft_vocab_coverage(draft_vocab, [r.tolist() for r in responses])
        log(f"draft vocabulary: {args.draft_vocab_size} ids from {len(counts_from)} ShareGPT replies; "
            f"covers {coverage:.1%} of the target's MT-bench tokens (a missed token can never be accepted)")
    drafter = make_drafter(target, num_layers=args.drafter_layers, draft_vocab_ids=draft_vocab)
    vocab_size = check_compatibility(target, drafter, tokenizer)

    cost = calibrate_cost_model(target, drafter, args.max_window, context_ids=torch.cat([prompt_ids[0], responses[0]])[None])
    log(f"cost model: t_d/t_t = {cost.drafter_cost:.3f}, t_v(L)/t_t = " + ", ".join(f"{c:.2f}" for c in cost.verify_cost))

    # Which contexts: confident-and-wrong positions of the drafter along the target's own text.
    scores, masks = [], []
    width = max(len(r) for r in responses)
    for prompt, response in zip(prompt_ids, responses):
        row = score_sequence(target, drafter, torch.cat([prompt, response]), len(prompt), vocab_size=vocab_size, kind="kl")
        scores.append(torch.nn.functional.pad(row, (0, width - len(row))))
        masks.append(torch.arange(width) < len(row))
    starts_probs = window_start_probabilities(torch.stack(scores), torch.stack(masks), beta=args.beta)
    starts = sample_window_starts(starts_probs, args.num_contexts, generator=torch.Generator().manual_seed(args.seed))
    contexts = [torch.cat([prompt_ids[s], responses[s][:t]]) for s, t in starts.tolist()]
    log(f"{len(contexts)} contexts chosen with beta={args.beta} (mean score of chosen: "
        f"{torch.stack(scores)[starts[:, 0], starts[:, 1]].mean():.3f} vs all: {torch.stack(scores)[torch.stack(masks)].mean():.3f})")

    policy = AdaptiveWindowPolicy(max_window=args.max_window, threshold=0.0)
    pad_id = tokenizer.pad_token_id
    report = {"target": str(target_path), "drafter_layers": args.drafter_layers, "draft_vocab_size": args.draft_vocab_size,
              "draft_vocab_coverage": coverage, "cost_model": cost.__dict__, "threads": threads, "precision": "fp32"}
    for mode, temperature in (("greedy", 0.0), ("sampling T=1", 1.0)):
        generator = torch.Generator().manual_seed(args.seed)
        drafted = draft_windows(drafter, contexts, policy, pad_id=pad_id, temperature=temperature,
                                vocab_size=vocab_size, generator=generator, target=target)
        p = target_window_probs(target, contexts, drafted.window_ids, pad_id=pad_id, temperature=temperature, vocab_size=vocab_size)
        mask = drafted.window_mask
        prefix = window_prefix_acceptance(drafted.window_ids, p, drafted.drafter_probs, mask, greedy=temperature == 0)
        accepted = prefix.sum(-1)
        lengths = mask.sum(-1)
        r_speed = speedup(accepted, lengths, cost)
        r_prox = proximity_reward(p, drafted.drafter_probs, mask, kind="tv")
        reward = window_reward(r_speed, r_prox, args.proximity_weight)
        # (K, h) for this regime, on the same contexts (the library's one calibration; it drafts its own windows)
        regime = "greedy" if temperature == 0 else "sampling"
        best, _ = calibrate_policy(target, drafter, contexts, cost, max_window=args.max_window, regime=regime,
                                   vocab_size=vocab_size, pad_id=pad_id, seed=args.seed)
        fixed = best.calibration["fixed_window_speedup"][regime]
        report[mode] = {
            "mean_accepted": accepted.mean().item(), "simulated_tau": accepted.mean().item() + 1,
            "R_speed": r_speed.mean().item(), "R_prox": r_prox.mean().item(), "R": reward.mean().item(),
            "fixed_K_speedup": fixed, "best_policy": best.__dict__,
            "best_policy_speedup": best.calibration["predicted_speedup"],
            "overall_speedup_fixed_K": overall_speedup(accepted, lengths, cost).item(),
        }
        log(f"{mode:13s}: E[A]={accepted.mean():.3f} (simulated tau {accepted.mean() + 1:.2f}, EAGLE convention: "
            f"tokens per target forward), R_speed={r_speed.mean():.3f}, R_prox={r_prox.mean():.3f}, "
            f"cost-model speedup fixed K={args.max_window}: {fixed:.2f}x; best (K={best.max_window}, h={best.threshold:.2f}): "
            f"{report[mode]['best_policy_speedup']:.2f}x")
    (out_dir / "summary.json").write_text(json.dumps(report, indent=2, default=str))
    log(f"wrote {out_dir / 'summary.json'}. The drafter is untrained, so tau is near 1 and speculative decoding is "
        "slower than the target: training it is PPOWTrainer's job.")
    return report


if __name__ == "__main__":
    main()
