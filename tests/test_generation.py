"""Speculative generation: lossless greedy output, exact sampling distribution, counting, exact tau."""

import copy

import pytest
import torch
from scipy.stats import chisquare

from conftest import make_bigram_llama, make_tiny_llama, make_tiny_tokenizer
from ppow_trl.serving.generation import exact_greedy_tau, speculative_generate
from ppow_trl.models import check_compatibility
from ppow_trl.core.windowing import AdaptiveWindowPolicy

EOS = 3  # make_tiny_llama's eos_token_id


def make_pair(num_layers=2, eos_boost=2.0, noise=0.005, seed=0):
    """A context-dependent target with peaked distributions and a drafter that is a noisy copy of it.

    The scaled head gives confidences spread over (0, 1), so thresholds change window lengths; the
    boosted EOS row makes EOS common (often inside a window); the noise makes the drafter right
    most of the time, not always. The models depend on the whole context, so KV-cache mistakes
    change the output.
    """
    target = make_tiny_llama(num_layers=num_layers, seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
        target.lm_head.weight[EOS].mul_(eos_boost)
    drafter = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * noise)
    return target, drafter


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def random_prompt(g, vocab=64, max_len=10):
    length = int(torch.randint(1, max_len + 1, (1,), generator=g))  # includes one-token prompts (no prefill)
    return torch.randint(8, vocab, (1, length), generator=g)


def target_greedy(target, prompt, max_new_tokens):
    out = target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=EOS, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


def uncached_greedy(model, prompt, num_tokens):
    """Greedy continuation without a KV cache and without stopping at EOS (generate's min_new_tokens bans EOS)."""
    sequence = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(num_tokens):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[prompt.shape[1] :]


@pytest.mark.parametrize("max_window", [1, 3, 5])
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7])
def test_greedy_is_lossless(pair, max_window, threshold):
    target, drafter = pair
    policy = AdaptiveWindowPolicy(max_window=max_window, threshold=threshold)
    g = torch.Generator().manual_seed(1000 * max_window + int(10 * threshold))
    eos_cut_inside_window = 0
    for _ in range(30):
        prompt = random_prompt(g)
        max_new_tokens = int(torch.randint(1, 17, (1,), generator=g))
        out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=max_new_tokens,
                                   eos_token_id=EOS)
        expected = target_greedy(target, prompt, max_new_tokens)
        assert out.new_tokens == expected, (prompt.tolist(), max_new_tokens)
        assert out.sequences[0].tolist() == prompt[0].tolist() + expected
        assert out.finished_by_eos == (EOS in expected)
        assert max(out.drafted_per_round) <= max_window
        eos_cut_inside_window += out.finished_by_eos and out.tokens_per_round[-1] < out.accepted_per_round[-1] + 1
    if max_window > 1:  # the EOS truncation path really ran
        assert eos_cut_inside_window > 0


def test_greedy_windows_really_vary(pair):
    """The threshold changes window lengths, and full and partial acceptances both occur (non-vacuous tests)."""
    target, drafter = pair
    g = torch.Generator().manual_seed(7)
    lengths, full, partial = set(), 0, 0
    for _ in range(10):
        out = speculative_generate(target, drafter, random_prompt(g), policy=AdaptiveWindowPolicy(5, 0.3),
                                   max_new_tokens=16, eos_token_id=[])
        lengths.update(out.drafted_per_round[:-1])
        full += sum(a == l for a, l in zip(out.accepted_per_round, out.drafted_per_round) if l > 0)
        partial += sum(0 < a < l for a, l in zip(out.accepted_per_round, out.drafted_per_round))
    assert len(lengths & {1, 2, 3, 4}) >= 2 and full > 0 and partial > 0


def test_max_new_tokens_caps_windows(pair):
    """Windows never draft past max_new_tokens - 1; the last token alone is a plain target step."""
    target, drafter = pair
    prompt = torch.tensor([[10, 20, 30]])
    for max_new_tokens in (1, 2, 4, 7):
        out = speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(5, 0.0),
                                   max_new_tokens=max_new_tokens, eos_token_id=[])
        assert len(out.new_tokens) == max_new_tokens
        assert out.new_tokens == uncached_greedy(target, prompt, max_new_tokens)
        done = 0
        for drafted, tokens in zip(out.drafted_per_round, out.tokens_per_round):
            assert drafted <= max_new_tokens - done - 1
            done += tokens
    assert speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(5), max_new_tokens=1,
                                eos_token_id=[]).drafted_per_round == [0]


def test_counts_match_forward_hooks(pair):
    target, drafter = pair
    calls = {"target": 0, "drafter": 0}
    hooks = [
        target.register_forward_hook(lambda *_: calls.__setitem__("target", calls["target"] + 1)),
        drafter.register_forward_hook(lambda *_: calls.__setitem__("drafter", calls["drafter"] + 1)),
    ]
    g = torch.Generator().manual_seed(3)
    try:
        for index in range(12):
            calls.update(target=0, drafter=0)
            prompt = random_prompt(g)
            policy = AdaptiveWindowPolicy(max_window=int(torch.randint(1, 6, (1,), generator=g)), threshold=0.3)
            out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=14, eos_token_id=EOS,
                                       do_sample=index % 2 == 1, generator=g)
            assert out.target_forwards == calls["target"]
            assert out.drafter_forwards == calls["drafter"]
            assert out.prefill_forwards == (1 if prompt.shape[1] > 1 else 0)
            assert out.verification_forwards == out.num_rounds == len(out.drafted_per_round)
            assert sum(out.tokens_per_round) == len(out.new_tokens)
            # every round yields A + 1 tokens; only the last can be cut (after an EOS)
            assert all(t == a + 1 for t, a in zip(out.tokens_per_round[:-1], out.accepted_per_round[:-1]))
            assert 1 <= out.tokens_per_round[-1] <= out.accepted_per_round[-1] + 1
            assert all(a <= d for a, d in zip(out.accepted_per_round, out.drafted_per_round))
            assert out.window_lengths == out.drafted_per_round
            assert out.tau == pytest.approx(len(out.new_tokens) / (calls["target"] - out.prefill_forwards))
            assert out.tau_with_prefill == pytest.approx(len(out.new_tokens) / calls["target"])
            hist = out.acceptance_histogram()
            assert len(hist) == policy.max_window + 1 and sum(hist) == out.num_rounds
            assert sum(a * n for a, n in enumerate(hist)) == sum(out.accepted_per_round)
    finally:
        for hook in hooks:
            hook.remove()


def test_exact_greedy_tau_equals_live_loop():
    target, drafter = make_pair(seed=1)
    g = torch.Generator().manual_seed(11)
    for _ in range(40):
        prompt = random_prompt(g)
        confidence_temperature = float(torch.rand((), generator=g)) + 0.5
        policy = AdaptiveWindowPolicy(max_window=int(torch.randint(1, 7, (1,), generator=g)),
                                      threshold=float(torch.rand((), generator=g)) ** 2,
                                      confidence_temperature=confidence_temperature)
        max_new_tokens = int(torch.randint(1, 21, (1,), generator=g))
        kwargs = dict(policy=policy, max_new_tokens=max_new_tokens, eos_token_id=EOS)
        live = speculative_generate(target, drafter, prompt, **kwargs)
        exact = exact_greedy_tau(target, drafter, prompt, **kwargs)
        assert exact.new_tokens == live.new_tokens
        assert exact.accepted_per_round == live.accepted_per_round
        assert exact.tokens_per_round == live.tokens_per_round
        assert exact.num_rounds == live.num_rounds and exact.target_forwards == live.target_forwards
        assert exact.tau == live.tau
        assert exact.acceptance_histogram() == live.acceptance_histogram()


def test_exact_greedy_tau_from_a_text_stopped_at_eos_equals_live_loop():
    """Regenerated data stops at EOS: that text (shorter than max_new_tokens) gives the live loop's rounds."""
    target, drafter = make_pair(seed=2)
    g = torch.Generator().manual_seed(12)
    checked = 0
    for _ in range(40):
        prompt = random_prompt(g)
        policy = AdaptiveWindowPolicy(max_window=int(torch.randint(1, 7, (1,), generator=g)),
                                      threshold=float(torch.rand((), generator=g)) ** 2)
        kwargs = dict(policy=policy, max_new_tokens=24, eos_token_id=EOS)
        live = speculative_generate(target, drafter, prompt, **kwargs)
        if live.new_tokens[-1] != EOS or len(live.new_tokens) == 24:
            continue
        checked += 1
        exact = exact_greedy_tau(target, drafter, prompt, continuation=live.new_tokens, **kwargs)
        assert exact.new_tokens == live.new_tokens
        assert exact.tokens_per_round == live.tokens_per_round and exact.tau == live.tau
    assert checked >= 5  # the boosted EOS row makes early stops common
    with pytest.raises(ValueError, match="no EOS"):
        exact_greedy_tau(target, drafter, random_prompt(g), continuation=[5, 6], policy=AdaptiveWindowPolicy(3),
                         max_new_tokens=24, eos_token_id=EOS)


def bigram_pair(vocab=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    target = make_bigram_llama(torch.randn(vocab, vocab, generator=g) * 1.2)
    drafter = make_bigram_llama(torch.randn(vocab, vocab, generator=g) * 1.2)
    return target, drafter


@pytest.mark.parametrize("temperature,threshold", [(1.0, 0.0), (0.7, 0.5)])
def test_sampling_matches_target_distribution(temperature, threshold):
    """Chi-square: the joint law of the first two sampled tokens is the target's own at that temperature."""
    vocab, prompt = 4, torch.tensor([[1, 2]])
    target, drafter = bigram_pair(vocab)
    with torch.no_grad():  # exact next-token law of the bigram target, from the model itself
        logits = target(torch.arange(vocab)[None]).logits[0]
        step = torch.softmax(logits / temperature, -1)
        first = torch.softmax(target(prompt).logits[0, -1] / temperature, -1)
    expected = (first[:, None] * step).flatten().double()
    expected = expected / expected.sum()
    # confidences at the sampling temperature: the adaptive rule then gives windows of 1 and 2 tokens
    policy = AdaptiveWindowPolicy(max_window=3, threshold=threshold, confidence_temperature=temperature)
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(vocab * vocab, dtype=torch.double)
    samples, rejections, drafted = 800, 0, 0
    for _ in range(samples):
        out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=3, do_sample=True,
                                   temperature=temperature, eos_token_id=[], generator=g)
        counts[out.new_tokens[0] * vocab + out.new_tokens[1]] += 1
        rejections += sum(a < d for a, d in zip(out.accepted_per_round, out.drafted_per_round))
        drafted += out.drafted_per_round[0]
    assert rejections > samples // 10  # the residual path is exercised
    assert drafted > samples  # windows of 2 tokens happen (the second token is drafted, not a bonus)
    _, p_value = chisquare(counts.numpy(), (expected * samples).numpy())
    assert p_value > 1e-3


def test_bad_inputs(pair):
    target, drafter = pair
    policy = AdaptiveWindowPolicy(max_window=3)
    with pytest.raises(ValueError, match="batch size 1"):
        speculative_generate(target, drafter, torch.ones(2, 4, dtype=torch.long), policy=policy, max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, drafter, torch.ones(1, 4, dtype=torch.long), policy=policy, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        exact_greedy_tau(target, drafter, torch.ones(1, 4, dtype=torch.long), policy=policy, max_new_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, drafter, torch.ones(1, 0, dtype=torch.long), policy=policy, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, drafter, torch.ones(1, 4, dtype=torch.long), policy=policy, max_new_tokens=4,
                             do_sample=True, temperature=0.0)

    tokenizer = make_tiny_tokenizer()  # 64 tokens
    small = make_tiny_llama(vocab_size=48, num_layers=1, seed=2)
    with pytest.raises(ValueError):
        check_compatibility(target, small, tokenizer)
    with pytest.raises(ValueError, match="check_compatibility"):
        speculative_generate(target, small, torch.ones(1, 4, dtype=torch.long), policy=policy, max_new_tokens=4)
    with pytest.raises(ValueError, match="vocab_size"):
        speculative_generate(target, small, torch.ones(1, 4, dtype=torch.long), policy=policy, max_new_tokens=4,
                             vocab_size=64)


def test_padded_drafter_vocabulary_with_check_compatibility(pair):
    """A drafter with more output rows than the tokenizer works through the shared vocabulary, losslessly."""
    target, _ = pair
    padded = make_tiny_llama(vocab_size=72, num_layers=1, seed=3)
    vocab = check_compatibility(target, padded, make_tiny_tokenizer())
    assert vocab == 64
    prompt = torch.tensor([[9, 17, 33, 40]])
    out = speculative_generate(target, padded, prompt, policy=AdaptiveWindowPolicy(3), max_new_tokens=10,
                               eos_token_id=EOS, vocab_size=vocab)
    assert out.new_tokens == target_greedy(target, prompt, 10)
    assert exact_greedy_tau(target, padded, prompt, policy=AdaptiveWindowPolicy(3), max_new_tokens=10,
                            eos_token_id=EOS, vocab_size=vocab).tau == out.tau


def test_sliding_window_target_rolls_back_after_rejections():
    """Sliding-window caches refuse to crop unless they record past states (as HF's assisted loop arranges)."""
    from transformers import MistralConfig, MistralForCausalLM

    from ppow_trl.serving.generation import speculative_generate
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    def mistral(seed, layers):
        torch.manual_seed(seed)
        config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                               max_position_embeddings=256, initializer_range=0.5, pad_token_id=0, eos_token_id=None)
        return MistralForCausalLM(config).eval()

    target, drafter = mistral(0, 2), mistral(1, 1)
    prompt = torch.randint(8, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    out = speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(4, 0.0), max_new_tokens=20,
                               eos_token_id=[])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=20, min_new_tokens=20, pad_token_id=0)
    assert out.new_tokens == reference[0, 12:].tolist()
    assert any(a < d for a, d in zip(out.accepted_per_round, out.drafted_per_round))  # rejections happened
