"""On-policy distillation on drafted windows (ppow_trl.training.on_policy): the teacher, the loss against brute force, and
training that brings the drafter closer to the target on its own windows."""

from __future__ import annotations

import torch
from conftest import make_tiny_llama

from ppow_trl.training.on_policy import on_policy_loss, on_policy_teacher, train_on_policy
from ppow_trl.core.rollout import draft_windows
from ppow_trl.core.windowing import AdaptiveWindowPolicy

VOCAB = 64


def _models():
    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5).eval()
    drafter = make_tiny_llama(num_layers=1, seed=1, initializer_range=0.5).eval()
    return target, drafter


def _contexts():
    return [torch.tensor([5, 9, 11, 4]), torch.tensor([7, 8]), torch.tensor([12, 13, 14, 15, 16])]


def _windows(drafter, contexts, group=2, k=3):
    return draft_windows(drafter, contexts, AdaptiveWindowPolicy(k, 0.0), temperature=1.0, vocab_size=VOCAB,
                         generator=torch.Generator().manual_seed(0), num_samples_per_context=group)


def test_teacher_is_the_targets_top_k_at_every_window_position():
    target, drafter = _models()
    contexts = _contexts()
    drafted = _windows(drafter, contexts)
    ids, logprobs = on_policy_teacher(target, contexts, drafted.window_ids, group=2, top_k=5, pad_id=0,
                                      vocab_size=VOCAB)
    for row in range(len(drafted.window_ids)):
        sequence = torch.cat([contexts[row // 2], drafted.window_ids[row]])
        with torch.no_grad():
            p = torch.softmax(target(sequence[None]).logits[0].double(), -1)
        for i in range(3):  # position i predicts window token i + 1 from c + y_<=i
            expected = p[len(contexts[row // 2]) - 1 + i].topk(5)
            torch.testing.assert_close(ids[row, i], expected.indices)
            torch.testing.assert_close(logprobs[row, i].double(), expected.values.log(), atol=1e-5, rtol=1e-5)


def test_loss_equals_brute_force_kl_plus_tv_and_reaches_the_drafter():
    """With the teacher's full vocabulary (top_k = V) the top-k losses are the exact KL(p||q) and TV(p, q)."""
    target, drafter = _models()
    contexts = _contexts()
    drafted = _windows(drafter, contexts)
    ids, logprobs = on_policy_teacher(target, contexts, drafted.window_ids, group=2, top_k=VOCAB, pad_id=0,
                                      vocab_size=VOCAB)
    drafter.train()
    loss, stats = on_policy_loss(drafter, contexts, drafted.window_ids, drafted.window_mask, ids, logprobs, group=2)
    loss.backward()
    grads = [p.grad for p in drafter.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)
    total = []
    with torch.no_grad():
        for row in range(len(drafted.window_ids)):
            sequence = torch.cat([contexts[row // 2], drafted.window_ids[row]])
            start = len(contexts[row // 2]) - 1
            p = torch.softmax(target(sequence[None]).logits[0].double(), -1)[start:start + 3]
            q = torch.softmax(drafter(sequence[None]).logits[0].double(), -1)[start:start + 3]
            total += list((p * (p / q).log()).sum(-1) + 0.5 * (p - q).abs().sum(-1))
    assert abs(float(loss) - float(torch.stack(total).mean())) < 1e-4


def test_training_on_its_own_windows_lowers_the_divergence():
    from datasets import Dataset

    from ppow_trl.training.contexts import ContextPool

    target, drafter = _models()
    rows = [{"prompt_ids": [5 + i, 9, 11], "response_ids": [(3 * i + j) % 50 + 4 for j in range(8)]} for i in range(6)]
    pool = ContextPool(Dataset.from_list(rows))
    contexts = [torch.tensor(pool.context(i)) for i in range(0, len(pool), 5)]

    def divergence():
        drafted = _windows(drafter, contexts, group=4)
        ids, logprobs = on_policy_teacher(target, contexts, drafted.window_ids, group=4, top_k=VOCAB, pad_id=0,
                                          vocab_size=VOCAB)
        with torch.no_grad():
            return float(on_policy_loss(drafter, contexts, drafted.window_ids, drafted.window_mask, ids, logprobs,
                                        group=4)[0])

    before = divergence()
    out = train_on_policy(drafter, target, pool, seconds=1e9, learning_rate=3e-3, contexts_per_step=4,
                          windows_per_context=2, max_window=3, top_k=16, vocab_size=VOCAB, seed=0,
                          probe=lambda model: {"divergence": divergence()}, probe_every=None, max_steps=30)
    after = divergence()
    assert out["optimizer_steps"] == 30 and out["trained_window_tokens"] == 30 * 4 * 2 * 3
    assert after < 0.7 * before, (before, after)
    assert out["curve"][0]["divergence"] == before and len(out["curve"]) == 2
