"""On-policy distillation of a drafter on its own windows (DistillSpec; TRL's GKD with ``lmbda = 1``).

Each step: contexts ``c`` drawn uniformly from the training text (``ContextPool``), ``G`` windows ``y`` of ``K`` tokens
sampled from the drafter at T = 1, the target's distribution ``p_i = p(. | c, y_<i)`` at every window position (one
forward, ``rollout.target_window_probs``), then the dense per-position loss on the drafter's teacher-forced
``q_i = q(. | c, y_<i)``:

    L = mean over window positions i of  KL(p_i || q_i) + TV(p_i, q_i)

both from the target's top-k plus the rest class (``kd_trainer.topk_forward_kl`` / ``topk_total_variation``, the KD
baseline's losses: only the data differs, the drafter's own windows instead of the target's text). Unlike TRL's
``GKDTrainer`` it works for every trainable drafter family (reduced heads, EAGLE-3 heads reading the target's
features), through the same ``window_hidden`` / ``output_head`` the PPOW loss uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .contexts import ContextPool
from ..drafting import family_of
from ..features import context_features
from .kd_trainer import topk_forward_kl, topk_total_variation, vocab_maps
from ..core.rollout import draft_windows, target_window_probs
from ..core.windowing import AdaptiveWindowPolicy


@torch.no_grad()
def on_policy_teacher(target, contexts: list[torch.Tensor], window_ids: torch.Tensor, *, group: int, top_k: int,
                      pad_id: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-k at each window position, ``(ids, log-probs)`` ``(B, K, k)`` each (temperature 1)."""
    probs = target_window_probs(target, contexts, window_ids, pad_id=pad_id, temperature=1.0, vocab_size=vocab_size,
                                num_samples_per_context=group)[:, :-1]
    top = probs.topk(top_k, dim=-1)
    return top.indices, top.values.clamp_min(1e-30).log()


def on_policy_loss(drafter, contexts: list[torch.Tensor], window_ids: torch.Tensor, window_mask: torch.Tensor,
                   teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, *, group: int, target=None,
                   features: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``mean_i KL(p_i || q_i) + TV(p_i, q_i)`` over the windows' positions, with gradients into the drafter."""
    family = family_of(drafter)
    inverse = torch.arange(len(contexts), device=window_ids.device).repeat_interleave(group)
    hidden = family.window_hidden(drafter, contexts, inverse, window_ids, target=target, features=features)
    head = family.output_head(drafter, target)
    mask = window_mask.to(hidden.device)
    logits = head(hidden[mask].to(head.weight.device))
    _, id_to_column = vocab_maps(drafter, logits.shape[-1], logits.device)
    ids, logprobs = teacher_ids.to(logits.device)[mask], teacher_logprobs.to(logits.device)[mask]
    kl = topk_forward_kl(logits, ids, logprobs, id_to_column)
    tv = topk_total_variation(logits, ids, logprobs, id_to_column)
    return (kl + tv).mean(), {"kl": float(kl.detach().mean()), "tv": float(tv.detach().mean())}


def train_on_policy(drafter, target, pool: ContextPool, *, seconds: float, learning_rate: float, contexts_per_step: int,
                    windows_per_context: int, max_window: int, top_k: int, vocab_size: int, pad_id: int = 0,
                    seed: int = 0, probe: Callable | None = None, probe_every: float | None = None,
                    max_steps: int | None = None) -> dict:
    """On-policy distillation for ``seconds`` of optimizer-step time (drafting, the target's forward, loss, backward
    and the optimizer; not the probes), or ``max_steps`` optimizer steps if given first. Returns ``{"optimizer_steps", "trained_window_tokens", "train_step_seconds",
    "curve", "log"}``; ``probe(model) -> dict`` runs at 0 s and every ``probe_every`` seconds, as
    ``study.budget.TrainingBudget`` does for the trainers."""
    family = family_of(drafter)
    layer_ids = family.target_layer_ids(drafter)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=learning_rate)
    generator = torch.Generator().manual_seed(seed)
    policy = AdaptiveWindowPolicy(max_window, 0.0)  # fixed windows: the teacher scores every position
    elapsed, steps, tokens, curve, log = 0.0, 0, 0, [], []
    next_probe = probe_every or float("inf")

    def record():
        if probe is not None:
            curve.append({"train_seconds": round(elapsed, 2), "step": steps, **probe(drafter)})

    record()
    while elapsed < seconds and (max_steps is None or steps < max_steps):
        started = time.perf_counter()
        candidates = torch.randint(len(pool), (contexts_per_step,), generator=generator)
        contexts = [torch.tensor(pool.context(int(c))) for c in candidates]
        features = context_features(target, contexts, layer_ids, pad_id) if layer_ids is not None else None
        drafter.eval()
        drafted = draft_windows(drafter, contexts, policy, pad_id=pad_id, temperature=1.0, vocab_size=vocab_size,
                                generator=generator, num_samples_per_context=windows_per_context, target=target,
                                features=features)
        teacher_ids, teacher_logprobs = on_policy_teacher(target, contexts, drafted.window_ids,
                                                          group=windows_per_context, top_k=top_k, pad_id=pad_id,
                                                          vocab_size=vocab_size)
        drafter.train()
        loss, stats = on_policy_loss(drafter, contexts, drafted.window_ids, drafted.window_mask, teacher_ids,
                                     teacher_logprobs, group=windows_per_context, target=target, features=features)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
        tokens += int(drafted.window_mask.sum())
        elapsed += time.perf_counter() - started
        log.append({"step": steps, "loss": float(loss), **stats})
        if elapsed >= next_probe and elapsed < seconds and (max_steps is None or steps < max_steps):
            record()
            while next_probe <= elapsed:
                next_probe += probe_every
    record()
    drafter.eval()
    return {"optimizer_steps": steps, "trained_window_tokens": tokens, "train_step_seconds": elapsed, "curve": curve,
            "log": log}
