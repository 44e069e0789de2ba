"""The hybrid drafter (ppow_trl.drafters.hybrid): the lookup's token where the text repeats, the trained drafter's elsewhere,
checked position by position against both parts; lossless, with the trained drafter run only where the lookup found
nothing; clear refusals. The family contract (save/load, the HF route, batched rollouts, exact tau, the cost unit)
runs in test_families.py."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target_and_drafters, make_tiny_llama

from ppow_trl.drafting import drafting_session, family_of, get_family
from ppow_trl.serving.generation import greedy_continuation, speculative_generate
from ppow_trl.drafters.hybrid import HybridDrafter, hybrid_drafter
from ppow_trl.drafters.prompt_lookup import lookup_next_token
from ppow_trl.core.windowing import AdaptiveWindowPolicy


@pytest.fixture(scope="module")
def models():
    target, _, close = make_target_and_drafters(seed=0, noise=0.3)
    return target, close, hybrid_drafter(close, target)


def _repeating_prompt(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(8, 64, (5,), generator=g)
    return torch.cat([phrase, torch.randint(8, 64, (3,), generator=g), phrase[:3]]).view(1, -1)


def _plain_and_hybrid(target, hybrid, seed: int, new_tokens: int):
    """Greedy plain decoding's tokens and the hybrid's speculative output (K = 3, h = 0) after a repeating prompt."""
    prompt = _repeating_prompt(seed)
    plain = greedy_continuation(target, prompt[0].tolist(), new_tokens, 64)
    return plain, speculative_generate(target, hybrid, prompt, policy=AdaptiveWindowPolicy(3, 0.0),
                                       max_new_tokens=new_tokens, eos_token_id=[])


def test_each_position_takes_the_lookup_where_it_matches_and_the_model_elsewhere(models):
    target, close, hybrid = models
    prompt = _repeating_prompt(0)[0].tolist()
    text = greedy_continuation(target, prompt, 12, 64)
    sequence = prompt + text
    with torch.no_grad():
        model_logits = close(torch.tensor([sequence])).logits[0]
    session = drafting_session(hybrid, target)
    with torch.no_grad():
        slots = dict(session.teacher_forced_logits(prompt, text, 1))
    for s in range(len(text)):  # slot 0 of a window after prompt + text[:s]
        context = sequence[: len(prompt) + s]
        looked_up = lookup_next_token(context, 3, 1)
        row = slots[0][s]
        if looked_up is not None:
            assert int(row.argmax()) == looked_up and float(row.max()) == 20.0
        else:
            torch.testing.assert_close(row, model_logits[len(context) - 1], atol=1e-5, rtol=1e-4)


def test_lossless_and_the_model_runs_only_where_the_lookup_found_nothing(models, monkeypatch):
    target, close, hybrid = models
    family = family_of(hybrid)
    sessions = []
    make_session = family.session
    monkeypatch.setattr(family, "session", lambda *a, **k: sessions.append(make_session(*a, **k)) or sessions[-1])
    for seed in range(4):
        plain, out = _plain_and_hybrid(target, hybrid, seed, 24)
        assert out.new_tokens == plain
        session = sessions[-1]
        drafted = sum(out.drafted_per_round)
        assert session.looked_up > 0  # the repeated phrase was looked up...
        assert session.model.forwards + session.looked_up == session.forwards == drafted  # ...not drafted by the model
        assert out.free_drafted == session.looked_up  # what the loop-overhead measurement does not charge t_d for
        # per round, as the guard and measure_loop_overhead read them: never more than the round drafted
        drafted_rounds = out.drafted_per_round
        assert sum(out.free_per_round) == session.looked_up and len(out.free_per_round) == len(drafted_rounds)
        assert all(0 <= free <= length for free, length in zip(out.free_per_round, drafted_rounds))


def test_refuses_drafters_that_do_not_draft_from_the_text_alone():
    target = make_tiny_llama(num_layers=4, vocab_size=64, seed=0)
    lookup = get_family("prompt_lookup").build(target)
    with pytest.raises(ValueError, match="standalone causal LM"):
        hybrid_drafter(lookup, target)
    eagle = get_family("eagle3").build(target, target_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match="standalone causal LM"):
        hybrid_drafter(eagle, target)
    with pytest.raises(ValueError, match="confidence_logit"):
        hybrid_drafter(make_tiny_llama(num_layers=1, vocab_size=64), target, confidence_logit=0.0)
    with pytest.raises(TypeError, match="session"):
        HybridDrafter.forward(hybrid_drafter(make_tiny_llama(num_layers=1, vocab_size=64), target))


def test_hf_route_keeps_its_session_across_calls_and_restarts_on_a_new_prompt(models):
    """The hook keeps the inner drafter's cache between the assistant calls of a generation; the same prompt again
    (the inner drafter has read all of it) and another prompt start over, lossless each time."""
    target, close, _ = models
    hybrid = hybrid_drafter(close, target)
    family_of(hybrid).attach(hybrid, target, AdaptiveWindowPolicy(3, 0.0))
    settings = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    for prompt in (_repeating_prompt(5), _repeating_prompt(5), _repeating_prompt(6)):
        with torch.no_grad():
            plain = target.generate(prompt, **settings)
            assert torch.equal(target.generate(prompt, assistant_model=hybrid, **settings), plain)


def test_calibration_charges_the_drafter_only_for_the_tokens_it_proposed(models):
    """Batched rollouts mark each drafted token as charged (the model proposed it) or free (a lookup), matching the
    lookup itself position by position; the speedup and the guard's break-even charge t_d only for the former."""
    from ppow_trl.serving.calibration import calibration_rollouts
    from ppow_trl.core.cost import CostModel
    from ppow_trl.core.rollout import draft_windows
    from ppow_trl.core.windowing import policy_speedup

    target, _, hybrid = models
    # repeated phrases (lookups find tokens) and distinct tokens (nothing to look up at first)
    contexts = [_repeating_prompt(seed)[0] for seed in range(3)]
    contexts += [torch.randperm(56, generator=torch.Generator().manual_seed(seed))[:9] + 8 for seed in range(3)]
    policy = AdaptiveWindowPolicy(3, 0.0)
    drafted = draft_windows(hybrid, contexts, policy, temperature=0.0, target=target)
    assert drafted.charged is not None and drafted.charged.shape == drafted.window_ids.shape
    for row, context in enumerate(contexts):
        sequence = context.tolist()
        for slot in range(3):
            free = lookup_next_token(sequence, 3, 1) is not None
            assert bool(drafted.charged[row, slot]) == (not free)
            sequence.append(int(drafted.window_ids[row, slot]))
    confidences, prefix, charged = calibration_rollouts(target, hybrid, contexts, max_window=3, greedy=True,
                                                        return_charged=True)
    assert 0 < charged.sum() < charged.numel()  # both kinds occur on these prompts
    cost = CostModel(drafter_cost=0.5, verify_cost=[1.0, 1.0, 1.0, 1.0])
    lengths = policy.window_lengths(confidences)
    assert torch.equal(policy.drafter_forwards(lengths, charged), charged.sum(1))
    assert policy_speedup(policy, confidences, prefix, cost, charged) > policy_speedup(policy, confidences, prefix, cost)
    free = CostModel(drafter_cost=0.0, verify_cost=[1.0, 1.0, 1.0, 1.0])
    everything_free = torch.zeros_like(charged)
    assert torch.allclose(policy_speedup(policy, confidences, prefix, cost, everything_free),
                          policy_speedup(policy, confidences, prefix, free))


def test_once_fitted_a_lookup_under_half_proposes_nothing_and_the_model_proposes_there(models):
    """With fitted hit rates (unigram 0.2, longer 0.8) and ``min_match_confidence = 0.5``, a position whose only match
    is a unigram takes the model's logits, a trigram match the lookup's at probability 0.8; copies made for the
    compiled runtime (``with_drafter``) share the fit; decoding stays lossless."""
    from ppow_trl.drafters.prompt_lookup import lookup_next_match

    target, close, _ = models
    hybrid = hybrid_drafter(close, target)
    copy = hybrid.with_drafter(close)
    hybrid.config.match_confidences = [0.2, 0.8, 0.8]
    prompt = _repeating_prompt(1)[0].tolist()
    text = greedy_continuation(target, prompt, 12, 64)
    sequence = prompt + text
    with torch.no_grad():
        model_logits = close(torch.tensor([sequence])).logits[0]
        slots = dict(drafting_session(copy, target).teacher_forced_logits(prompt, text, 1))
    kinds = set()
    for s in range(len(text)):
        context = sequence[: len(prompt) + s]
        match = lookup_next_match(context, 3, 1)
        row = slots[0][s]
        if match is not None and match[1] >= 2:
            kinds.add("lookup")
            assert int(row.argmax()) == match[0] and abs(float(torch.softmax(row, -1).max()) - 0.8) < 1e-4
        else:
            kinds.add("unigram" if match is not None else "model")
            torch.testing.assert_close(row, model_logits[len(context) - 1], atol=1e-5, rtol=1e-4)
    assert {"lookup", "unigram"} <= kinds  # both cases were checked
    for seed in range(3):
        plain, out = _plain_and_hybrid(target, copy, seed, 20)
        assert out.new_tokens == plain
