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
from ppow_trl.serving.windowing import AdaptiveWindowPolicy


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
