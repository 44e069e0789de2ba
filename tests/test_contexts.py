"""Candidate contexts, batched divergence scoring and the hierarchical ContextSelector."""

import json

import pytest
import torch
from datasets import Dataset

from ppow_trl.training.contexts import (
    MAX_MULTINOMIAL_CATEGORIES,
    ContextPool,
    ContextSelector,
    score_sequence,
    score_sequences,
)
from ppow_trl.core.verification import probabilities_from_logits
from ppow_trl.core.windowing import divergence_scores, window_start_probabilities



def one_at_a_time(target, drafter, ids, prompt_length, vocab_size, target_temperature, drafter_temperature, kind):
    """The scoring PPOWTrainer did before batching: one unpadded forward per model, on the CPU."""
    def probs(model, temperature):
        logits = model(input_ids=ids[None]).logits[0, prompt_length - 1 : -1, :vocab_size]
        return probabilities_from_logits(logits.float(), temperature)

    return divergence_scores(probs(target, target_temperature), probs(drafter, drafter_temperature), kind=kind)


def random_sequences(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 12), (1, 5), (7, 1), (2, 20), (5, 0), (4, 9), (2, 15)]  # (prompt, response) lengths
    sequences = [torch.randint(8, 64, (p + r,), generator=g) for p, r in shapes]
    return sequences, [p for p, _ in shapes]


@pytest.mark.parametrize("kind,target_temperature,drafter_temperature", [("kl", 1.0, 1.0), ("tv", 0.0, 0.7), ("js", 1.3, 1.0)])
def test_batched_scores_equal_one_at_a_time_scores(tiny_target, tiny_drafter, kind, target_temperature, drafter_temperature):
    sequences, prompt_lengths = random_sequences()
    kwargs = dict(vocab_size=64, target_temperature=target_temperature, drafter_temperature=drafter_temperature, kind=kind)
    with torch.no_grad():
        want = [one_at_a_time(tiny_target, tiny_drafter, s, p, **kwargs) for s, p in zip(sequences, prompt_lengths)]
    # one batch of all seven (different lengths, one empty response), batches of three, and one sequence per batch
    for options in (dict(), dict(batch_size=3), dict(max_batch_logits=1)):
        got = score_sequences(tiny_target, tiny_drafter, sequences, prompt_lengths, pad_id=0, **kwargs, **options)
        assert [len(g) for g in got] == [len(s) - p for s, p in zip(sequences, prompt_lengths)]
        for g, w in zip(got, want):
            assert g.dtype == torch.float32
            assert torch.allclose(g, w, atol=1e-5, rtol=0), (options, (g - w).abs().max())
    single = score_sequence(tiny_target, tiny_drafter, sequences[3], prompt_lengths[3], **kwargs)
    assert single.device.type == "cpu" and torch.allclose(single, want[3], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="prompt"):
        score_sequences(tiny_target, tiny_drafter, [sequences[0]], [0], vocab_size=64)


def flat_probabilities(lengths, scores, scored, beta, eps, uniform_share):
    """The flat computation: unscored candidates at the mean scored value, then window_start_probabilities."""
    scores = scores.clone()
    if scored.any() and not scored.all():
        scores[~scored] = scores[scored].mean()
    mask = torch.ones(1, int(lengths.sum()), dtype=torch.bool)
    return window_start_probabilities(scores[None], mask, beta, eps, uniform_share)[0].double()


def implied_probabilities(selector):
    per_sequence = selector.sequence_probabilities()
    assert per_sequence.shape == (selector.num_sequences,)
    assert float(per_sequence.sum()) == pytest.approx(1.0, abs=1e-12)
    parts = []
    for s in range(selector.num_sequences):
        within = selector.position_probabilities(s)
        assert len(within) == int(selector.lengths[s])
        if len(within):
            assert float(within.sum()) == pytest.approx(1.0, abs=1e-12)
        parts.append(per_sequence[s] * within)
    return torch.cat(parts)


@pytest.mark.parametrize("beta,uniform_share", [(1.0, 0.1), (0.0, 0.1), (3.0, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("fraction_scored", [0.0, 0.4, 1.0])
def test_hierarchical_probabilities_equal_the_flat_ones(beta, uniform_share, fraction_scored):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([17, 0, 1, 40, 5, 0, 23, 64, 2, 9])
    n = int(lengths.sum())
    # KL-like scores: mostly small, a few near the ~87-nat clamp of a missing token
    scores = torch.rand(n, generator=g) ** 4 * 5
    scores[torch.randint(0, n, (4,), generator=g)] = 87.0
    selector = ContextSelector(lengths, beta=beta, eps=1e-3, uniform_share=uniform_share, seed=3)
    chosen = torch.randperm(n, generator=g)[: int(fraction_scored * n)]
    selector.set_scores(chosen, scores[chosen])
    want = flat_probabilities(lengths, selector.scores, selector.scored, beta, 1e-3, uniform_share)
    got = implied_probabilities(selector)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-4), (got - want).abs().max()
    assert torch.allclose(selector.probabilities().double(), want, atol=1e-6, rtol=1e-4)
    # a draw only ever returns candidates of non-empty sequences, in range
    drawn = selector.draw(0, 500)
    assert drawn.dtype == torch.long and drawn.min() >= 0 and drawn.max() < n


def test_draws_follow_the_selection_probabilities():
    """Chi-square goodness of fit of 40 000 draws (20 rounds) on a 30-candidate pool."""
    scipy_stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 0, 5, 1, 7, 14])
    selector = ContextSelector(lengths, beta=1.0, eps=1e-2, uniform_share=0.1, seed=0)
    selector.set_scores(torch.arange(20), torch.rand(20, generator=g) * 2)  # 10 unscored: mean fill
    expected = implied_probabilities(selector)
    draws = torch.cat([selector.draw(r, 2000) for r in range(20)])
    counts = torch.bincount(draws, minlength=int(lengths.sum())).double()
    assert counts.sum() == len(draws)
    statistic, p_value = scipy_stats.chisquare(counts.numpy(), (expected * len(draws)).numpy())
    assert p_value > 1e-3, (statistic, p_value)
    # and the per-sequence marginals, within 5 standard deviations
    sequence_of = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    share = torch.bincount(sequence_of[draws], minlength=len(lengths)).double() / len(draws)
    p = selector.sequence_probabilities()
    assert ((share - p).abs() <= 5 * (p * (1 - p) / len(draws)).sqrt() + 1e-12).all(), (share, p)


def test_draws_are_a_function_of_seed_round_and_scores():
    lengths = torch.tensor([4, 9, 2, 30])
    make = lambda seed=0: ContextSelector(lengths, beta=2.0, eps=1e-3, uniform_share=0.1, seed=seed)  # noqa: E731
    a, b = make(), make()
    for selector in (a, b):
        selector.set_scores(torch.arange(10, 30), torch.linspace(0, 3, 20))
    assert torch.equal(a.draw(5, 64), b.draw(5, 64))
    assert torch.equal(a.draw(5, 64), a.draw(5, 64))  # drawing does not advance any shared state
    assert not torch.equal(a.draw(5, 64), a.draw(6, 64))
    c = make()
    c.load_state_dict(a.state_dict())  # a resumed run
    assert torch.equal(c.draw(7, 64), a.draw(7, 64))
    assert not torch.equal(make(seed=1).draw(5, 64), make().draw(5, 64))


def test_a_pool_of_more_than_two_to_the_24_candidates(monkeypatch):
    """4 100 sequences x 4 096 starts = 16.8M candidates: each multinomial has at most 4 100 categories."""
    num_sequences, length = 4100, 4096
    assert num_sequences * length > MAX_MULTINOMIAL_CATEGORIES
    selector = ContextSelector(torch.full((num_sequences,), length), beta=1.0, eps=1e-3, uniform_share=0.1, seed=0)
    assert selector.num_candidates == num_sequences * length
    star = 3 * length + 1000  # one confident-and-wrong position among ~16.8M scored 0
    scores = torch.zeros(selector.num_candidates)
    scores[star] = 1e5
    selector.set_scores(torch.arange(selector.num_candidates), scores)

    categories = []
    multinomial = torch.multinomial

    def recording_multinomial(probabilities, *args, **kwargs):
        categories.append(probabilities.shape[-1])
        return multinomial(probabilities, *args, **kwargs)

    monkeypatch.setattr(torch, "multinomial", recording_multinomial)
    monkeypatch.setattr(ContextSelector, "probabilities", lambda self: pytest.fail("the flat vector was built"))
    draws = torch.cat([selector.draw(r, 500) for r in range(4)])
    assert categories and max(categories) <= max(num_sequences, length)
    assert draws.min() >= 0 and draws.max() < selector.num_candidates
    # P(star) = 0.9 * 1e5 / (1e5 + ~16.8M * 1e-3) + 0.1 / N ~ 0.771
    p_star = float(selector.sequence_probabilities()[3] * selector.position_probabilities(3)[1000])
    assert p_star == pytest.approx(0.9 * 1e5 / (1e5 + 1e-3 * (selector.num_candidates - 1)), rel=1e-6)
    share = float((draws == star).double().mean())
    assert abs(share - p_star) < 5 * (p_star * (1 - p_star) / len(draws)) ** 0.5, (share, p_star)


def test_an_integer_pool_size_still_works():
    selector = ContextSelector(10_000, beta=1.0, eps=1e-3, uniform_share=0.1)
    assert selector.num_candidates == 10_000 and int(selector.lengths.max()) <= 4096
    assert torch.allclose(selector.probabilities(), torch.full((10_000,), 1e-4))
    with pytest.raises(ValueError, match="beta"):
        ContextSelector([3], beta=-1.0, eps=1e-3, uniform_share=0.1)


def test_state_is_a_compact_tensor_file_and_old_json_files_still_load(tmp_path):
    lengths = torch.randint(0, 200, (500,), generator=torch.Generator().manual_seed(0))
    selector = ContextSelector(lengths, beta=1.0, eps=1e-3, uniform_share=0.1, seed=7)
    n = selector.num_candidates
    selector.set_scores(torch.arange(0, n, 3), torch.rand(len(range(0, n, 3))))
    selector.last_refresh_step, selector.refresh_count = 40, 3
    path = selector.save_state(tmp_path / "ppow_context_selector.pt")
    assert path.stat().st_size < 5 * n + 2 * len(lengths) * 4 + 20_000  # float32 scores + bool flags + lengths
    state = torch.load(path, weights_only=True)
    assert state["scores"].dtype == torch.float32 and state["scored"].dtype == torch.bool

    restored = ContextSelector(lengths, beta=1.0, eps=1e-3, uniform_share=0.1, seed=7)
    restored.load_state(path)
    assert torch.equal(restored.scores, selector.scores) and torch.equal(restored.scored, selector.scored)
    assert (restored.last_refresh_step, restored.refresh_count) == (40, 3)
    assert torch.equal(restored.draw(11, 32), selector.draw(11, 32))

    # what earlier versions wrote: JSON lists, no lengths
    legacy = tmp_path / "ppow_context_selector.json"
    legacy.write_text(json.dumps({"scores": selector.scores.tolist(), "scored": selector.scored.tolist(), "seed": 7,
                                  "last_refresh_step": 40, "refresh_count": 3}))
    from_json = ContextSelector(lengths, beta=1.0, eps=1e-3, uniform_share=0.1, seed=7)
    from_json.load_state(legacy)
    assert torch.equal(from_json.scores, selector.scores) and torch.equal(from_json.scored, selector.scored)
    assert torch.equal(from_json.draw(11, 32), selector.draw(11, 32))

    other = ContextSelector(torch.cat([lengths, torch.tensor([5])]), beta=1.0, eps=1e-3, uniform_share=0.1)
    for source in (path, legacy):
        with pytest.raises(ValueError, match="resume with the same training data"):
            other.load_state(source)
    shuffled = ContextSelector(lengths.flip(0), beta=1.0, eps=1e-3, uniform_share=0.1)  # same total, other sequences
    with pytest.raises(ValueError, match="resume with the same training data"):
        shuffled.load_state(path)


def test_pool_numbers_candidates_sequence_major():
    data = Dataset.from_dict({"prompt_ids": [[9, 10], [11], [12, 13, 14], [15]],
                              "response_ids": [[20, 21, 22], [], [23], [24, 25]]})
    pool = ContextPool(data)
    assert len(pool) == 6 and pool.lengths.tolist() == [3, 0, 1, 2] and pool.offsets.tolist() == [0, 3, 3, 4]
    want = [[9, 10], [9, 10, 20], [9, 10, 20, 21], [12, 13, 14], [15], [15, 24]]
    assert [pool.context(i) for i in range(6)] == want
    sequence, start = pool.locate(torch.arange(6))
    assert sequence.tolist() == [0, 0, 0, 2, 3, 3] and start.tolist() == [0, 1, 2, 0, 0, 1]
    assert pool.candidates_of([3, 1, 0]).tolist() == [4, 5, 0, 1, 2]
    with pytest.raises(IndexError):
        pool.context(6)
    dataset = pool.candidate_dataset()
    assert len(dataset) == 6 and dataset[4] == {"candidate": 4, "prompt": [15]}
    selector = ContextSelector(pool.lengths, beta=1.0, eps=1e-3, uniform_share=0.1)
    assert selector.num_candidates == len(pool)
    assert set(selector.draw(0, 200).tolist()) == set(range(6))


def test_scores_of_a_pool_land_on_its_candidates(tiny_target, tiny_drafter):
    """score_sequences' rows, concatenated in candidates_of order, are the scores of those candidates."""
    sequences, prompt_lengths = random_sequences(1)
    data = Dataset.from_dict({"prompt_ids": [s[:p].tolist() for s, p in zip(sequences, prompt_lengths)],
                              "response_ids": [s[p:].tolist() for s, p in zip(sequences, prompt_lengths)]})
    pool = ContextPool(data)
    order = [4, 1, 6, 0]
    rows = score_sequences(tiny_target, tiny_drafter, [pool.sequence_ids(s) for s in order],
                           [len(pool.prompts[s]) for s in order], vocab_size=64)
    candidates = pool.candidates_of(order)
    scores = torch.cat(rows)
    assert len(candidates) == len(scores)
    with torch.no_grad():
        for c, value in zip(candidates.tolist()[::5], scores.tolist()[::5]):
            sequence, start = (int(t) for t in pool.locate(c))
            ids = pool.sequence_ids(sequence)
            prompt_length = len(pool.prompts[sequence])
            want = one_at_a_time(tiny_target, tiny_drafter, ids, prompt_length, 64, 1.0, 1.0, "kl")[start]
            assert value == pytest.approx(float(want), abs=1e-5)
