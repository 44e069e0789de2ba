"""Batched drafting and target scoring equal what each context gives alone."""

import pytest
import torch

from ppow_trl.core.rollout import draft_windows, left_pad, target_window_probs, length_buckets
from ppow_trl.core.verification import greedy_accepted_length
from ppow_trl.core.windowing import AdaptiveWindowPolicy


def random_contexts(seed, count=5, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab, (int(n),), generator=g) for n in torch.randint(3, 12, (count,), generator=g)]


def test_greedy_windows_equal_unbatched_greedy_generation(tiny_drafter):
    contexts = random_contexts(0)
    policy = AdaptiveWindowPolicy(max_window=4, threshold=0.0)
    drafted = draft_windows(tiny_drafter, contexts, policy, temperature=0.0)
    assert drafted.window_ids.shape == (5, 4) and drafted.window_mask.all()
    for row, context in enumerate(contexts):
        alone = tiny_drafter.generate(context[None], do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
        assert drafted.window_ids[row].tolist() == alone[0, len(context) :].tolist()


def test_target_probs_equal_unpadded_forward(tiny_target):
    contexts = random_contexts(1)
    windows = torch.randint(8, 64, (5, 3), generator=torch.Generator().manual_seed(2))
    probs = target_window_probs(tiny_target, contexts, windows)
    assert probs.shape == (5, 4, 64)
    for row, context in enumerate(contexts):
        full = torch.cat([context, windows[row]])[None]
        alone = torch.softmax(tiny_target(full).logits[0, len(context) - 1 :], -1)
        assert torch.allclose(probs[row], alone, atol=1e-5)


def test_greedy_acceptance_matches_target_generation(tiny_target, tiny_drafter):
    """Accepted length from the core = leading agreement of the window with the target's greedy text."""
    contexts = random_contexts(3, count=6)
    policy = AdaptiveWindowPolicy(max_window=5)
    drafted = draft_windows(tiny_drafter, contexts, policy, temperature=0.0)
    probs = target_window_probs(tiny_target, contexts, drafted.window_ids, temperature=0.0)
    accepted = greedy_accepted_length(drafted.window_ids, probs, drafted.window_mask)
    for row, context in enumerate(contexts):
        target_text = tiny_target.generate(context[None], do_sample=False, max_new_tokens=5, min_new_tokens=5, pad_token_id=0)
        target_text = target_text[0, len(context) :].tolist()
        run = 0
        while run < 5 and drafted.window_ids[row, run].item() == target_text[run]:
            run += 1
        assert accepted[row].item() == run


def test_policy_threshold_shortens_windows_and_sampling_is_seeded(tiny_drafter):
    contexts = random_contexts(4)
    short = draft_windows(tiny_drafter, contexts, AdaptiveWindowPolicy(6, 1.0), temperature=1.0)
    assert (short.window_mask.sum(-1) == 1).all()
    a = draft_windows(tiny_drafter, contexts, AdaptiveWindowPolicy(6), generator=torch.Generator().manual_seed(0))
    b = draft_windows(tiny_drafter, contexts, AdaptiveWindowPolicy(6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.window_ids, b.window_ids)
    assert torch.allclose(a.drafter_probs.sum(-1), torch.ones(5, 6))


def test_empty_context_is_rejected():
    with pytest.raises(ValueError, match="empty"):
        left_pad([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], 0)
    with pytest.raises(ValueError, match="No contexts"):
        left_pad([], 0)


def test_shared_context_cache_equals_repeated_contexts(tiny_target, tiny_drafter):
    """G windows per context from one prefill (KV reuse) equal G separate copies of the context."""
    contexts = random_contexts(5, count=3)
    group = 4
    policy = AdaptiveWindowPolicy(max_window=3)
    shared = draft_windows(tiny_drafter, contexts, policy, num_samples_per_context=group,
                           generator=torch.Generator().manual_seed(0))
    repeated_contexts = [c for c in contexts for _ in range(group)]
    repeated = draft_windows(tiny_drafter, repeated_contexts, policy, generator=torch.Generator().manual_seed(0))
    assert torch.equal(shared.window_ids, repeated.window_ids)
    assert torch.allclose(shared.drafter_probs, repeated.drafter_probs, atol=1e-5)
    p_shared = target_window_probs(tiny_target, contexts, shared.window_ids, num_samples_per_context=group)
    p_repeated = target_window_probs(tiny_target, repeated_contexts, shared.window_ids)
    assert torch.allclose(p_shared, p_repeated, atol=1e-5)
    with pytest.raises(ValueError, match="windows for"):
        target_window_probs(tiny_target, contexts, shared.window_ids)


def test_length_buckets_bound_the_padding():
    lengths = [200, 12, 190, 15, 60, 58, 14]
    buckets = length_buckets(lengths, max_padding=0.2)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        longest = max(lengths[i] for i in bucket)
        assert 1 - sum(lengths[i] for i in bucket) / (len(bucket) * longest) <= 0.2
    assert length_buckets([50, 48, 49]) == [[0, 2, 1]]  # little padding: one bucket


@pytest.mark.parametrize("group", [1, 3])
def test_bucketed_prefill_equals_each_context_alone(tiny_target, group):
    """Contexts of very different lengths run in buckets and merge into one cache: every row sees what it would
    see alone (target probabilities against an unpadded forward), in the given order."""
    g = torch.Generator().manual_seed(4)
    lengths = [40, 3, 37, 5, 20]
    contexts = [torch.randint(8, 64, (n,), generator=g) for n in lengths]
    assert len(length_buckets(lengths)) > 1
    windows = torch.randint(8, 64, (len(contexts) * group, 3), generator=g)
    probs = target_window_probs(tiny_target, contexts, windows, num_samples_per_context=group)
    for row in range(len(windows)):
        context = contexts[row // group]
        full = torch.cat([context, windows[row]])[None]
        alone = torch.softmax(tiny_target(full).logits[0, len(context) - 1 :], -1)
        assert torch.allclose(probs[row], alone, atol=1e-5)
