"""KD trained tokens per second, before and after, side by side in one run, with the loss curves.

The same teacher-forced ShareGPT data (``build_teacher_forced``, <= 256 answer tokens, labels cached) trains a fresh
drafter for the same steps from the same seed in each arm, interleaved arm by arm in chunks of steps (machine load
hits every arm alike), one process and one torch thread (the main job runs two such processes):

- ``before``: how KD ran before this benchmark: fp32, random batches (padded to their longest sequence), the
  attention mask passed to SDPA;
- ``after``: ``bf16_autocast`` (where the CPU has avx512_bf16 / AMX; fp32 elsewhere), length-grouped batches
  (``train_sampling_strategy="group_by_length"``), right-padded batches without a mask (``causal_only``).

For the 2-layer drafter (the main job's) and an EAGLE-3 head (target features precomputed, training-time test of 3
steps). ``trained_tokens_per_second``: response positions trained (the loss's, all TTT steps counted once) over the
seconds inside ``train()``; ``loss_curve``: the logged KD loss per step; ``held_out_kl``: KL on held-out rows after
training (the loss must stay equal within noise). Written under the key ``kd`` of
``benchmarks/results/trainer_throughput.json`` (the PPOW rows of ``benchmarks/trainer_throughput.py`` are kept).

    python benchmarks/kd_throughput.py
    python benchmarks/kd_throughput.py --conversations 24 --steps 4 --out /tmp/kd.json     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, TrainerCallback, set_seed

from ppow_trl import KDConfig, KDTrainer
from ppow_trl.data import build_teacher_forced, compute_target_features, load_sharegpt_conversations
from ppow_trl.drafters import standalone
from ppow_trl.drafting import get_family
from ppow_trl.models import build_draft_vocab, load_target
from ppow_trl.offline import smollm2_path
from ppow_trl.utils import bf16_matmuls_are_fast, cache_root, cpu_summary, set_cpu_threads


class StepClock(TrainerCallback):
    """Seconds inside training steps (from the first step's start to the last step's end)."""

    def __init__(self):
        self.seconds, self._start = 0.0, None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds += time.perf_counter() - self._start


def make_drafter(family_name, target, tokenizer, vocab):
    family = get_family(family_name)
    options = {"num_layers": 2} if family_name == "standalone" else {}
    set_seed(0)
    drafter = family.build(target, tokenizer, draft_vocab_ids=vocab, target_name_or_path="smollm2", **options)
    if family_name == "standalone":  # as the recipe trains it: the target's embedding kept frozen
        drafter.get_input_embeddings().requires_grad_(False)
    return drafter.train()


def run_arm(arm: str, family_name: str, target, tokenizer, train, held_out, vocab, steps: int, batch: int,
            work: Path) -> dict:
    after = arm == "after"
    bf16 = after and bf16_matmuls_are_fast()
    drafter = make_drafter(family_name, target, tokenizer, vocab)
    args = KDConfig(output_dir=str(work / f"{family_name}-{arm}"), max_steps=steps, per_device_train_batch_size=batch,
                    learning_rate=5e-4, lr_scheduler_type="cosine", warmup_steps=max(1, steps // 10), logging_steps=1,
                    save_strategy="no", report_to="none", seed=0, use_cpu=True, disable_tqdm=True,
                    bf16_autocast=bf16, train_sampling_strategy="group_by_length" if after else "random")
    trainer = KDTrainer(model=drafter, args=args, train_dataset=train, processing_class=tokenizer, target=target)
    clock = StepClock()
    trainer.add_callback(clock)
    original = standalone.causal_only
    if not after:  # before: the mask always reaches SDPA
        standalone.causal_only = lambda mask: mask
    try:
        trainer.train()
        held = trainer.evaluate(eval_dataset=held_out)
    finally:
        standalone.causal_only = original
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    tokens = trainer.trained_positions
    return {"bf16_autocast": bf16, "sampling": args.train_sampling_strategy, "steps": steps, "batch": batch,
            "trained_tokens": tokens, "seconds": clock.seconds, "trained_tokens_per_second": tokens / clock.seconds,
            "loss_curve": losses, "held_out_kl": held["eval_kd/kl"], "held_out_top1": held["eval_kd/top1_agreement"]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--held-out", type=int, default=24)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--families", nargs="+", default=["standalone", "eagle3"])
    parser.add_argument("--out", default="benchmarks/results/trainer_throughput.json")
    args = parser.parse_args(argv)

    threads = set_cpu_threads()
    target = load_target(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    conversations = load_sharegpt_conversations("train", num_samples=args.conversations + args.held_out, seed=7)
    data = build_teacher_forced(target, tokenizer, conversations, max_response_tokens=256, precision="bf16"
                                if bf16_matmuls_are_fast() else "fp32", cache_dir=cache_root() / "teacher-forced")
    train, held_out = data.select(range(len(data) - args.held_out)), data.select(range(len(data) - args.held_out,
                                                                                       len(data)))
    vocab = build_draft_vocab(train["response_ids"], 8192, len(tokenizer), always_include=tokenizer.all_special_ids)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for family_name in args.families:
            family_train, family_held = train, held_out
            probe = make_drafter(family_name, target, tokenizer, vocab)
            layer_ids = get_family(family_name).target_layer_ids(probe)
            if layer_ids is not None:  # an EAGLE-3 head reads the target's features, computed once like the recipe's
                features = cache_root() / "features"
                family_train = compute_target_features(target, train, layer_ids, cache_dir=features)
                family_held = compute_target_features(target, held_out, layer_ids, cache_dir=features)
            arms = {arm: run_arm(arm, family_name, target, tokenizer, family_train, family_held, vocab, args.steps,
                                 args.batch, Path(work)) for arm in ("before", "after")}
            arms["speedup"] = arms["after"]["trained_tokens_per_second"] / arms["before"]["trained_tokens_per_second"]
            results[family_name] = arms
            print(f"{family_name}: before {arms['before']['trained_tokens_per_second']:.0f}, after "
                  f"{arms['after']['trained_tokens_per_second']:.0f} trained tokens/s ({arms['speedup']:.2f}x); "
                  f"held-out KL {arms['before']['held_out_kl']:.3f} -> {arms['after']['held_out_kl']:.3f}", flush=True)
    kd = {"command": "python benchmarks/kd_throughput.py", "cpu": cpu_summary(), "threads": threads,
          "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
          "data": f"{len(train)} teacher-forced ShareGPT answers ({sum(map(len, train['response_ids'])):,} tokens), "
                  f"{len(held_out)} held out", **results}
    out = Path(args.out)
    existing = json.loads(out.read_text()) if out.is_file() else {}
    existing["kd"] = kd
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(existing, indent=2) + "\n")
    return kd


if __name__ == "__main__":
    main()
