"""Greedy rewards from the cached target text equal the target-verified ones (ppow_trl.training.cached_verification)."""

import pytest
import torch

from ppow_trl.training.cached_verification import (
    PAST_TEXT,
    cached_next_tokens,
    leaves_cached_text,
    verify_windows_from_cache,
)
from ppow_trl.core.cost import CostModel
from ppow_trl.core.rollout import reached_positions, verify_windows, window_rewards
from ppow_trl.core.windowing import AdaptiveWindowPolicy

COST = CostModel(0.1, [1.0, 1.5, 1.8, 2.0, 2.2])


def _contexts(data, starts_per_response=None):
    """Every prefix of each response (start 0 .. len, so windows also run past the text's end)."""
    contexts, responses, starts = [], [], []
    for prompt, response in zip(data["prompt_ids"], data["response_ids"]):
        for start in starts_per_response or range(len(response) + 1):
            start = min(start, len(response))
            contexts.append(torch.tensor(list(prompt) + list(response[:start])))
            responses.append(torch.tensor(response))
            starts.append(start)
    return contexts, responses, starts


def _compare(target, drafter, contexts, responses, starts, policy, vocab, *, temperature, group=2, pad_id=0):
    """Both paths on the same windows (same generator seeds); returns (target rewards, cache rewards, target rows)."""
    nexts = cached_next_tokens(responses, starts, policy.max_window + 1)
    pairs, fallback = [], 0
    for first in range(0, len(contexts), 8):
        batch, nt = contexts[first:first + 8], nexts[first:first + 8]
        verified = verify_windows(target, drafter, batch, policy, greedy=True, temperature=temperature, pad_id=pad_id,
                                  vocab_size=vocab, generator=torch.Generator().manual_seed(first),
                                  num_samples_per_context=group)
        cached, rows = verify_windows_from_cache(drafter, batch, nt, policy, target=target, temperature=temperature,
                                                 pad_id=pad_id, vocab_size=vocab,
                                                 generator=torch.Generator().manual_seed(first),
                                                 num_samples_per_context=group)
        assert torch.equal(verified.drafted.window_ids, cached.drafted.window_ids)
        pairs.append((window_rewards(verified, COST, proximity_positions="reached"),
                      window_rewards(cached, COST, proximity_positions="reached")))
        fallback += rows
    merged = [{key: torch.cat([pair[i][key] for pair in pairs]) for key in pairs[0][0]} for i in (0, 1)]
    return merged[0], merged[1], fallback


def _assert_equal_rewards(by_target, by_cache):
    for key in ("accepted", "prefix", "lengths", "speed", "proximity", "credit"):
        torch.testing.assert_close(by_cache[key], by_target[key], rtol=0, atol=1e-6, msg=key)


def test_next_tokens_and_leaving_the_text():
    nexts = cached_next_tokens([torch.tensor([5, 6, 7])], [1], 4)
    assert nexts.tolist() == [[6, 7, PAST_TEXT, PAST_TEXT]]
    mask = torch.ones(3, 3, dtype=torch.bool)
    windows = torch.tensor([[6, 7, 1], [6, 1, 1], [6, 7, 1]])
    # row 0 matched both cached tokens and drafts a 3rd: verification reaches past the text; row 1 stops at a
    # mismatch; row 2 is row 0 cut to two tokens (its bonus position is never needed for A or R_prox).
    mask[2, 2] = False
    assert leaves_cached_text(windows, mask, nexts.expand(3, -1)).tolist() == [True, False, False]


def test_reached_positions_are_the_matches_and_the_first_mismatch():
    prefix = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.25, 0.1, 0.0]])
    mask = torch.tensor([[True] * 4, [True] * 4, [True, True, True, False]])
    assert reached_positions(prefix, mask).tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 0.5, 0.25, 0]]


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_cache_rewards_equal_target_rewards_on_tiny_models(tiny_target, tiny_tokenizer, temperature):
    """A close drafter (the target itself, perturbed) matches long runs, so windows reach past the responses' ends and
    the target-verified fallback is exercised too."""
    from tests.conftest import tiny_word_responses

    data = tiny_word_responses(tiny_target, tiny_tokenizer, count=6)
    drafter = type(tiny_target)(tiny_target.config).eval()
    drafter.load_state_dict(tiny_target.state_dict())
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)) * 0.02)
    contexts, responses, starts = _contexts(data)
    policy = AdaptiveWindowPolicy(4, 0.0)
    by_target, by_cache, fallback = _compare(tiny_target, drafter, contexts, responses, starts, policy,
                                             len(tiny_tokenizer), temperature=temperature)
    _assert_equal_rewards(by_target, by_cache)
    if temperature == 0:  # both paths, full matches and early mismatches were exercised
        assert by_target["accepted"].max() == 4 and by_target["accepted"].min() == 0
        assert 0 < fallback < len(by_target["accepted"]) / 2


def test_cache_needs_greedy_acceptance_and_reached_positions():
    from ppow_trl import PPOWConfig

    with pytest.raises(ValueError, match="reward_source='cache' needs acceptance='greedy'"):
        PPOWConfig(output_dir="unused", reward_source="cache", max_window=4, num_generations=2,
                   per_device_train_batch_size=2)
    with pytest.raises(ValueError, match="needs proximity_positions='reached'"):
        PPOWConfig(output_dir="unused", reward_source="cache", acceptance="greedy", proximity_positions="window",
                   max_window=4, num_generations=2, per_device_train_batch_size=2)
    config = PPOWConfig(output_dir="unused", reward_source="cache", acceptance="greedy", max_window=4,
                        num_generations=2, per_device_train_batch_size=2)
    assert config.proximity_positions == "reached"


@pytest.mark.slow
def test_cache_rewards_equal_target_rewards_on_smollm2():
    """Real contexts: SmolLM2's batched greedy responses to MT-bench prompts, a 2-layer truncated drafter."""
    from transformers import AutoTokenizer

    from ppow_trl.data import build_target_responses, load_prompts
    from ppow_trl.drafting import get_family
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path

    path = smollm2_path()
    target, tokenizer = load_target(path), AutoTokenizer.from_pretrained(path)
    data = build_target_responses(target, tokenizer, load_prompts("mtbench", num_samples=4), max_new_tokens=24,
                                  batch_size=4)
    # 24 of the 30 layers: a close drafter, so windows match long runs (and some run past the text)
    drafter = get_family("standalone").build(target, tokenizer, num_layers=24, seed=0).eval()
    contexts, responses, starts = _contexts(data, starts_per_response=[0, 5, 11, 17, 22])
    by_target, by_cache, _ = _compare(target, drafter, contexts, responses, starts, AdaptiveWindowPolicy(6, 0.0),
                                      len(tokenizer), temperature=0.0, group=1, pad_id=tokenizer.pad_token_id)
    _assert_equal_rewards(by_target, by_cache)
    assert by_target["accepted"].max() >= 1 and by_target["accepted"].min() == 0
