"""Prompt lookup as a drafter family (ppow_trl.drafters.prompt_lookup): the lookup against brute force, its distribution and
window rule, sampling that keeps the target's law, and the benchmark and study taking it without a caller's change."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import first_two_tokens_test, make_bigram_llama, make_tiny_llama

from ppow_trl.drafting import get_family
from ppow_trl.serving.generation import speculative_generate
from ppow_trl.drafters.prompt_lookup import lookup_next_token
from ppow_trl.core.windowing import AdaptiveWindowPolicy


def brute_force_lookup(sequence, max_n, min_n):
    """Every earlier occurrence of every suffix, the longest suffix first, then the latest occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(sequence):
            continue
        suffix = sequence[-n:]
        starts = [s for s in range(len(sequence) - n) if sequence[s : s + n] == suffix]
        if starts:
            return sequence[max(starts) + n]
    return None


def test_lookup_equals_brute_force():
    rng = random.Random(0)
    for _ in range(2000):
        sequence = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        max_n = rng.randrange(1, 5)
        min_n = rng.randrange(1, max_n + 1)
        assert lookup_next_token(sequence, max_n, min_n) == brute_force_lookup(sequence, max_n, min_n), sequence


def test_distribution_is_confident_on_a_match_and_uniform_without_one():
    target = make_tiny_llama(vocab_size=64, num_layers=1)
    drafter = get_family("prompt_lookup").build(target)
    logits = drafter.lookup_logits([[5, 6, 7, 5, 6], [1, 2, 3]])
    probs = torch.softmax(logits, -1)
    assert probs[0].argmax() == 7 and probs[0, 7] > 0.999  # "5 6" was followed by 7
    assert torch.allclose(probs[1], torch.full((64,), 1 / 64))  # nothing recurs: the window rule stops
    rule = AdaptiveWindowPolicy(4, 0.5)
    assert rule.keep_drafting(rule.confidence(logits), 1).tolist() == [True, False]


def test_sampling_keeps_the_targets_law():
    """Chi-square on the first two sampled tokens: speculative sampling with the lookup's near one-hot q (rejected
    often, on a random bigram target) reproduces the target's own distribution."""
    vocab, prompt = 4, torch.tensor([[1, 2, 1]])
    g = torch.Generator().manual_seed(0)
    target = make_bigram_llama(torch.randn(vocab, vocab, generator=g) * 1.2, num_layers=1)
    drafter = get_family("prompt_lookup").build(target)
    samples = 600
    p_value, drafted, rejections = first_two_tokens_test(target, drafter, prompt, vocab, samples)
    assert drafted > samples and rejections > samples // 10  # the lookup drafted (prompt "1 2 1": "1" recurs)
    assert p_value > 1e-3


def test_repeated_text_is_drafted_and_accepted():
    """On a target that repeats a cycle, lookups after one period are what the target says: tau rises well above 1."""
    vocab = 8
    table = torch.full((vocab, vocab), -8.0)
    for token in range(vocab):
        table[token, (token + 3) % vocab] = 8.0  # a deterministic cycle of period 8
    target = make_bigram_llama(table, num_layers=1)
    drafter = get_family("prompt_lookup").build(target)
    prompt = torch.tensor([[0, 3, 6, 1, 4, 7, 2, 5, 0]])  # one full period
    out = speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(6, 0.5), max_new_tokens=24,
                               eos_token_id=[])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences[0], reference[0]) and out.tau > 4


@pytest.mark.parametrize("argv", [["--family", "prompt_lookup"]])
def test_bench_takes_the_family_by_name(argv):
    from ppow_trl.bench.cli import parse_args

    args = parse_args(argv + ["--num-prompts", "1"])
    assert args.family == ["prompt_lookup"] and args.drafter_layers == []
    with pytest.raises(SystemExit):
        parse_args(["--family", "no_such_family"])


def test_study_lists_it_as_an_evaluated_arm():
    from ppow_trl.study.arms import ARMS, ORDER

    assert ARMS["prompt_lookup"].kind == "eval" and "prompt_lookup" in ORDER


def test_match_counts_equal_a_lookup_at_every_position_and_the_fit_sets_each_lengths_probability():
    """``match_counts`` (one pass, n-grams in dicts) against ``lookup_next_match`` run after every prefix; sequences
    that are a prefix of another counted once; ``p_n = (hits + 1) / (lookups + 2)``; and a looked-up token's softmax
    probability is its length's ``p_n`` (``match_logit``), zeros under ``min_match_confidence``."""
    from ppow_trl.drafters.prompt_lookup import fit_match_confidences, lookup_next_match, match_counts

    rng = random.Random(1)
    for _ in range(200):
        sequences = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(1, 4))]
        max_n = rng.randrange(1, 5)
        min_n = rng.randrange(1, max_n + 1)
        lookups, hits = [0] * max_n, [0] * max_n
        for sequence in sequences:
            for t in range(1, len(sequence)):
                match = lookup_next_match(sequence[:t], max_n, min_n)
                if match is not None:
                    lookups[match[1] - 1] += 1
                    hits[match[1] - 1] += match[0] == sequence[t]
        assert match_counts(sequences, max_n, min_n) == (lookups, hits)
        assert match_counts(sequences + [s[: len(s) // 2] for s in sequences], max_n, min_n) == (lookups, hits)
        assert fit_match_confidences(sequences, max_n, min_n) == [(h + 1) / (n + 2) for n, h in zip(lookups, hits)]
    target = make_tiny_llama(vocab_size=64, num_layers=1)
    drafter = get_family("prompt_lookup").build(target)
    drafter.config.match_confidences = [0.2, 0.6, 0.9]
    probs = torch.softmax(drafter.lookup_logits([[5, 6, 7, 5, 6], [1, 9, 3, 9], [4, 5, 6, 7, 4, 5, 6]]), -1)
    assert probs[0].argmax() == 7 and abs(float(probs[0, 7]) - 0.6) < 1e-5  # "5 6": a bigram
    assert probs[1].argmax() == 3 and abs(float(probs[1, 3]) - 0.2) < 1e-5  # "9": a unigram
    assert probs[2].argmax() == 7 and abs(float(probs[2, 7]) - 0.9) < 1e-5  # "4 5 6": a trigram
    drafter.config.min_match_confidence = 0.5
    assert torch.equal(drafter.lookup_logits([[1, 9, 3, 9]]), torch.zeros(1, 64))  # the unigram: no match now
    with pytest.raises(ValueError, match="match_confidences"):
        get_family("prompt_lookup").build(target).config.__class__(match_confidences=[0.5, 1.0, 0.5])


def test_calibration_fits_the_hit_rates_and_a_threshold_then_drafts_only_on_matches_worth_it():
    """On text where unigram matches miss and trigram matches hit, the calibration fits p_1 low and p_3 high, records
    them (and the served rule's sentence names them), a threshold of 1/2 then ends a window at a unigram lookup and not
    at a trigram one, and decoding stays lossless."""
    from ppow_trl.serving.calibration import calibrate_policy
    from ppow_trl.core.cost import CostModel

    target = make_tiny_llama(vocab_size=64, num_layers=1)
    drafter = get_family("prompt_lookup").build(target)
    g = torch.Generator().manual_seed(3)
    contexts = []
    for _ in range(8):  # a phrase repeated (trigram matches continue it), then fresh tokens (unigram matches miss)
        phrase = torch.randint(8, 64, (6,), generator=g)
        contexts.append(torch.cat([phrase, phrase, phrase, torch.randint(8, 64, (20,), generator=g)]))
    cost = CostModel(drafter_cost=0.0, verify_cost=[1.0, 1.05, 1.1, 1.15, 1.2])
    policy, _ = calibrate_policy(target, drafter, contexts, cost, max_window=4, allow_no_speculation=True)
    p = policy.calibration["fitted_confidences"]["match_confidences"]
    assert p == drafter.config.match_confidences and p[2] > 0.7 > 0.3 > p[0]
    assert "hit rate per match length" in get_family("prompt_lookup").describe(drafter)
    from ppow_trl.serving.rule import describe_serving_rule

    assert f"hit rate, 1/2/3 = {p[0]:.2f}/{p[1]:.2f}/{p[2]:.2f}" in describe_serving_rule(policy, cost)
    rule = AdaptiveWindowPolicy(4, 0.5)  # a window continues while its confidence is >= 1/2
    unigram, trigram = [1, 9, 3, 9], [4, 5, 6, 7, 4, 5, 6]  # "9" recurs alone; "4 5 6" recurs
    assert rule.keep_drafting(rule.confidence(drafter.lookup_logits([unigram, trigram])), 1).tolist() == [False, True]
    ids = contexts[0][:14].view(1, -1)
    plain = speculative_generate(target, drafter, ids, policy=AdaptiveWindowPolicy(max_window=0), max_new_tokens=16)
    fast = speculative_generate(target, drafter, ids, policy=AdaptiveWindowPolicy(4, 0.5), max_new_tokens=16)
    assert torch.equal(fast.sequences, plain.sequences)
