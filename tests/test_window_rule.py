"""One window rule everywhere: a saved policy gives the same window lengths in our fast loop, in
`target.generate(assistant_model=...)` (the HF hook) and in the training rollout, for the same drafter and
contexts; greedy drafting follows h (confidences at the policy's temperature, not one-hot q)."""

import copy

import pytest
import torch

from ppow_trl.serving.assisted import load_assistant, save_assistant
from ppow_trl.serving.generation import speculative_generate
from ppow_trl.core.rollout import draft_windows
from ppow_trl.core.windowing import AdaptiveWindowPolicy

from test_assisted import generate, make_models, prompts, spy, without_eos


@pytest.mark.parametrize("threshold,confidence_temperature", [(0.35, 1.0), (0.6, 0.7), (0.2, 1.5)])
def test_saved_policy_gives_the_same_windows_in_the_loop_the_hook_and_the_rollout(
    tmp_path, threshold, confidence_temperature
):
    target, _, drafter = make_models(seed=2)  # a drafter close to the target: long accepted runs
    folder = save_assistant(copy.deepcopy(drafter), tmp_path / "drafter",
                            policy=AdaptiveWindowPolicy(4, threshold, confidence_temperature))
    policy = AdaptiveWindowPolicy.from_pretrained(folder)
    assistant = load_assistant(folder)
    without_eos(target, assistant)
    new_tokens, compared, lengths_seen = 14, 0, set()
    for prompt in prompts(8, seed=3):
        fast = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=new_tokens, eos_token_id=[])
        rounds = spy(assistant)
        hf = generate(target, prompt, assistant_model=assistant, do_sample=False, max_new_tokens=new_tokens)
        assert hf[0, prompt.shape[1]:].tolist() == fast.new_tokens  # lossless, so the rounds see the same contexts
        hook_lengths = [len(r["sequence"]) - r["start"] for r in rounds]
        fast_lengths = [n for n in fast.drafted_per_round if n > 0]  # HF does not call the drafter for 0 tokens
        assert hook_lengths == fast_lengths

        # the rollout after each round's context, capped as the loop caps (room left before max_new_tokens)
        done, contexts, caps = 0, [], []
        for emitted in fast.tokens_per_round:
            caps.append(min(policy.max_window, new_tokens - done - 1))
            contexts.append(torch.cat([prompt[0], torch.tensor(fast.new_tokens[:done], dtype=torch.long)]))
            done += emitted
        drafted = draft_windows(drafter, contexts, policy, temperature=0.0, vocab_size=64)
        rollout_lengths = [min(int(n), cap) for n, cap in zip(drafted.window_mask.sum(-1), caps)]
        assert rollout_lengths == fast.drafted_per_round
        compared += len(rollout_lengths)
        lengths_seen.update(fast_lengths)
    assert compared > 20 and len(lengths_seen) > 1  # the rule really varied the windows
