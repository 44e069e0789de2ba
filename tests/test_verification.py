"""Verification core against brute-force and Monte-Carlo versions of the formulas of PPOW.md."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppow_trl.core.verification import (
    acceptance_histogram,
    acceptance_probabilities,
    expected_accepted_length,
    greedy_accepted_length,
    greedy_verify,
    lengths_to_mask,
    probabilities_from_logits,
    residual_distribution,
    speculative_sampling_verify,
)


def random_probs(generator, *shape, sharpness=2.0):
    return torch.softmax(sharpness * torch.randn(*shape, generator=generator), dim=-1)


def brute_force_expected_length(alpha_row, length):
    """E[A] by enumerating every accept/reject pattern of the first `length` positions."""
    total = 0.0
    for pattern in itertools.product([0, 1], repeat=length):
        prob = 1.0
        for accepted, a in zip(pattern, alpha_row[:length]):
            prob *= a if accepted else 1 - a
        run = 0
        for accepted in pattern:
            if not accepted:
                break
            run += 1
        total += prob * run
    return total


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), max_window=st.integers(1, 6), vocab=st.integers(2, 7))
def test_expected_length_equals_brute_force(seed, max_window, vocab):
    g = torch.Generator().manual_seed(seed)
    batch = 4
    p = random_probs(g, batch, max_window + 1, vocab)
    q = random_probs(g, batch, max_window, vocab)
    window = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(batch, max_window)
    lengths = torch.randint(0, max_window + 1, (batch,), generator=g)
    mask = lengths_to_mask(lengths, max_window)
    alpha = acceptance_probabilities(window, p, q, mask)
    closed = expected_accepted_length(alpha, mask)
    for b in range(batch):
        want = brute_force_expected_length(alpha[b].tolist(), int(lengths[b]))
        assert closed[b].item() == pytest.approx(want, abs=1e-5)
        ratio = p[b, : lengths[b]].gather(-1, window[b, : lengths[b], None]).squeeze(-1) / q[b, : lengths[b]].gather(
            -1, window[b, : lengths[b], None]
        ).squeeze(-1)
        assert torch.allclose(alpha[b, : lengths[b]], ratio.clamp(max=1), atol=1e-6)
    assert (alpha[~mask] == 0).all()


def test_closed_form_matches_simulated_speculative_sampling():
    """E[A|y] in closed form equals the mean accepted length of simulated verification of that window."""
    g = torch.Generator().manual_seed(0)
    max_window, vocab, trials = 5, 6, 40_000
    p = random_probs(g, 1, max_window + 1, vocab, sharpness=1.0)
    q = random_probs(g, 1, max_window, vocab, sharpness=1.0)
    window = q[0].argmax(-1, keepdim=True).T  # a fixed, plausible window
    mask = torch.ones(1, max_window, dtype=torch.bool)
    closed = expected_accepted_length(acceptance_probabilities(window, p, q, mask), mask).item()
    expand = lambda t: t.expand(trials, *t.shape[1:])  # noqa: E731
    result = speculative_sampling_verify(expand(window), expand(p), expand(q), expand(mask), generator=g)
    simulated = result.accepted_length.float()
    stderr = simulated.std().item() / trials**0.5
    assert abs(simulated.mean().item() - closed) < 4 * stderr + 1e-3


def chi_square_p_value(counts, probs):
    from scipy.stats import chisquare

    expected = probs / probs.sum() * counts.sum()
    return chisquare(counts.numpy(), expected.numpy()).pvalue


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_reproduces_target_distribution(temperature):
    """Two rounds of draft-then-verify emit tokens distributed as the target's own samples (chi-square).

    The target is context dependent: p(. | previous token) from a random bigram table, and so is the
    drafter, so acceptance, residual and bonus paths all matter.
    """
    pytest.importorskip("scipy")
    g = torch.Generator().manual_seed(1)
    vocab, max_window, trials = 5, 2, 60_000
    target_table = probabilities_from_logits(torch.randn(vocab, vocab, generator=g) * 1.5, temperature)
    drafter_table = probabilities_from_logits(torch.randn(vocab, vocab, generator=g) * 1.5, temperature)
    start = torch.zeros(trials, dtype=torch.long)
    # drafter proposes y1 ~ q(.|start), y2 ~ q(.|y1)
    q1 = drafter_table[start]
    y1 = torch.multinomial(q1, 1, generator=g).squeeze(-1)
    q2 = drafter_table[y1]
    y2 = torch.multinomial(q2, 1, generator=g).squeeze(-1)
    window = torch.stack([y1, y2], dim=-1)
    p = torch.stack([target_table[start], target_table[y1], target_table[y2]], dim=1)
    q = torch.stack([q1, q2], dim=1)
    mask = torch.ones(trials, max_window, dtype=torch.bool)
    result = speculative_sampling_verify(window, p, q, mask, generator=g)
    first = torch.where(result.accepted_length >= 1, y1, result.next_token)
    # The first emitted token must follow p(. | start).
    counts = torch.bincount(first, minlength=vocab).double()
    assert chi_square_p_value(counts, target_table[0].double()) > 1e-3
    # Jointly, (first, second) emitted tokens must follow p(x1) p(x2 | x1) where two tokens were emitted.
    two = result.accepted_length >= 1
    second = torch.where(result.accepted_length >= 2, y2, result.next_token)[two]
    pair_counts = torch.bincount(y1[two] * vocab + second, minlength=vocab * vocab).double()
    # Conditioned on A >= 1 the first token has law min(p,q)/(1-TV); the second follows p(.|x1).
    accept_first = torch.minimum(target_table[0], drafter_table[0])
    joint = (accept_first[:, None] * target_table).flatten().double()
    assert chi_square_p_value(pair_counts, joint / joint.sum()) > 1e-3


def test_bonus_token_after_full_window_comes_from_last_distribution():
    vocab = 4
    p = torch.zeros(1, 3, vocab)
    p[0, 0, 1] = p[0, 1, 2] = 1.0
    p[0, 2, 3] = 1.0  # bonus position
    q = p[:, :2].clone()
    window = torch.tensor([[1, 2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    result = speculative_sampling_verify(window, p, q, mask)
    assert result.accepted_length.item() == 2 and result.next_token.item() == 3


def test_residual_distribution_basics():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    q = torch.tensor([[0.2, 0.6, 0.2]])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([[1.0, 0.0, 0.0]]))
    # identical distributions: no residual mass, falls back to p (finite, sums to 1)
    same = residual_distribution(p, p)
    assert torch.allclose(same, p) and torch.isfinite(same).all()


def test_identical_distributions_accept_everything():
    g = torch.Generator().manual_seed(3)
    p = random_probs(g, 8, 5, 11)
    window = torch.multinomial(p[:, :4].reshape(-1, 11), 1, generator=g).view(8, 4)
    mask = torch.ones(8, 4, dtype=torch.bool)
    alpha = acceptance_probabilities(window, p, p[:, :4], mask)
    assert torch.equal(alpha, torch.ones_like(alpha))
    assert torch.equal(expected_accepted_length(alpha, mask), torch.full((8,), 4.0))
    assert (speculative_sampling_verify(window, p, p[:, :4], mask, generator=g).accepted_length == 4).all()


def test_zero_probabilities_at_drafted_token_stay_finite():
    p = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    q = torch.tensor([[[1.0, 0.0]]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    # target gives the drafted token 0 probability -> alpha 0
    assert acceptance_probabilities(torch.tensor([[0]]), p, q, mask).item() == 0.0
    # drafter gave it probability 0 (could not have sampled it) but the target can -> limit of the ratio, 1
    assert acceptance_probabilities(torch.tensor([[1]]), p, q, mask).item() == 1.0
    # both zero -> 0, and never NaN
    p0 = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    alpha = acceptance_probabilities(torch.tensor([[1]]), p0, q, mask)
    assert alpha.item() == 0.0


def test_empty_windows_and_all_padding_rows():
    g = torch.Generator().manual_seed(4)
    p = random_probs(g, 3, 4, 6)
    q = random_probs(g, 3, 3, 6)
    window = torch.zeros(3, 3, dtype=torch.long)
    mask = lengths_to_mask(torch.tensor([0, 0, 3]), 3)
    alpha = acceptance_probabilities(window, p, q, mask)
    assert (expected_accepted_length(alpha, mask)[:2] == 0).all()
    result = speculative_sampling_verify(window, p, q, mask, generator=g)
    assert (result.accepted_length[:2] == 0).all()
    # an empty window yields one token sampled from p_1 (a plain target step)
    assert torch.isfinite(residual_distribution(p[:, 0], q[:, 0])).all()
    # zero-width windows (K = 0 tensors) still verify: every row emits one target token
    empty = speculative_sampling_verify(
        torch.zeros(3, 0, dtype=torch.long), p[:, :1], q[:, :0], torch.zeros(3, 0, dtype=torch.bool), generator=g
    )
    assert (empty.accepted_length == 0).all()


def test_greedy_verification_leading_run_and_next_token():
    vocab = 5
    target_tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    p = torch.nn.functional.one_hot(target_tokens, vocab).float()
    window = torch.tensor([[1, 2, 0], [0, 2, 3], [1, 2, 3]])
    mask = lengths_to_mask(torch.tensor([3, 3, 2]), 3)
    assert greedy_accepted_length(window, p, mask).tolist() == [2, 0, 2]
    result = greedy_verify(window, p, mask)
    assert result.next_token.tolist() == [3, 1, 3]
    # logits work as well as probabilities for greedy verification
    assert greedy_accepted_length(window, p * 7 - 2, mask).tolist() == [2, 0, 2]


def test_greedy_is_speculative_sampling_with_one_hot_distributions():
    g = torch.Generator().manual_seed(5)
    logits_p = torch.randn(16, 5, 9, generator=g)
    logits_q = logits_p[:, :4] + 0.8 * torch.randn(16, 4, 9, generator=g)
    p, q = probabilities_from_logits(logits_p, 0), probabilities_from_logits(logits_q, 0)
    window = q.argmax(-1)
    mask = lengths_to_mask(torch.randint(0, 5, (16,), generator=g), 4)
    greedy = greedy_verify(window, p, mask)
    sampled = speculative_sampling_verify(window, p, q, mask, generator=g)
    assert torch.equal(greedy.accepted_length, sampled.accepted_length)
    assert torch.equal(greedy.next_token, sampled.next_token)
    alpha = acceptance_probabilities(window, p, q, mask)
    assert torch.equal(expected_accepted_length(alpha, mask), greedy.accepted_length.float())


def test_greedy_verify_one_is_greedy_verify_of_the_one_hot_target():
    """The generation loop's greedy path (argmaxes, no one-hot) against ``greedy_verify`` on every window length,
    including ties in the logits (both take the first maximum) and the empty window."""
    from ppow_trl.core.verification import greedy_verify_one

    g = torch.Generator().manual_seed(8)
    for trial in range(200):
        length = trial % 5
        logits = torch.randint(0, 3, (length + 1, 7), generator=g).float()  # many ties
        choices = logits.argmax(-1)
        window = torch.where(torch.rand(length, generator=g) < 0.6, choices[:length],
                             torch.randint(0, 7, (length,), generator=g))
        expected = greedy_verify(window.view(1, length), probabilities_from_logits(logits, 0).unsqueeze(0),
                                 torch.ones((1, length), dtype=torch.bool))
        assert greedy_verify_one(window.tolist(), logits) == (int(expected.accepted_length[0]),
                                                              int(expected.next_token[0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_float32_finite_results(dtype):
    g = torch.Generator().manual_seed(6)
    p = random_probs(g, 4, 4, 50).to(dtype)
    q = random_probs(g, 4, 3, 50).to(dtype)
    window = q.float().argmax(-1)
    mask = torch.ones(4, 3, dtype=torch.bool)
    alpha = acceptance_probabilities(window, p, q, mask)
    assert alpha.dtype == torch.float32 and torch.isfinite(alpha).all()
    reference = acceptance_probabilities(window, p.float(), q.float(), mask)
    assert torch.allclose(alpha, reference)
    result = speculative_sampling_verify(window, p, q, mask, generator=g)
    assert ((result.next_token >= 0) & (result.next_token < 50)).all()


def test_bad_shapes_raise_clear_errors():
    p = torch.softmax(torch.randn(2, 3, 5), -1)
    q = torch.softmax(torch.randn(2, 2, 6), -1)
    with pytest.raises(ValueError, match="shared vocabulary"):
        acceptance_probabilities(torch.zeros(2, 2, dtype=torch.long), p, q, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="K \\+ 1"):
        greedy_accepted_length(torch.zeros(2, 3, dtype=torch.long), p, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="temperature"):
        probabilities_from_logits(torch.randn(3), -1.0)


def test_window_prefix_acceptance_sums_to_the_accepted_length():
    from ppow_trl.core.verification import window_prefix_acceptance

    g = torch.Generator().manual_seed(7)
    p = random_probs(g, 6, 5, 8)
    q = random_probs(g, 6, 4, 8)
    window = q.argmax(-1)
    mask = lengths_to_mask(torch.tensor([0, 1, 2, 3, 4, 4]), 4)
    greedy = window_prefix_acceptance(window, p, q, mask, greedy=True)
    assert torch.equal(greedy.sum(-1), greedy_accepted_length(window, p, mask).float())
    assert set(greedy.unique().tolist()) <= {0.0, 1.0} and (greedy[:, 1:] <= greedy[:, :-1]).all()
    sampled = window_prefix_acceptance(window, p, q, mask)
    assert torch.allclose(sampled.sum(-1), expected_accepted_length(acceptance_probabilities(window, p, q, mask), mask))


def test_acceptance_histogram_counts_rounds_by_accepted_length():
    """hist[a] = rounds with A = a, a = 0..K: against a brute-force count over random lengths."""
    generator = torch.Generator().manual_seed(0)
    for max_window in (1, 2, 5, 8):
        for num_rounds in (0, 1, 7, 50):
            lengths = torch.randint(0, max_window + 1, (num_rounds,), generator=generator).tolist()
            hist = acceptance_histogram(lengths, max_window)
            assert len(hist) == max_window + 1 and sum(hist) == num_rounds
            assert hist == [sum(1 for length in lengths if length == a) for a in range(max_window + 1)]
    for bad in ([3], [-1]):
        with pytest.raises(ValueError, match="outside"):
            acceptance_histogram(bad, 2)


def test_sample_categorical_draws_the_given_distribution():
    """Inverse-CDF sampling: chi-square against the distribution; zero-probability entries are never drawn."""
    from scipy.stats import chisquare

    from ppow_trl.core.verification import sample_categorical

    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 0.1, 0.0, 0.0, 0.9]])
    draws = sample_categorical(probs.repeat(10_000, 1).view(10_000, 2, 5), g)
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=5)
        support = probs[row] > 0
        assert (counts[~support] == 0).all()
        _, p_value = chisquare(counts[support].numpy(), (probs[row][support] * 10_000).numpy())
        assert p_value > 1e-3
