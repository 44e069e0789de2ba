"""The trainer's loss path, credit, refusals, held-out evaluation and calibration, on tiny models.

- the shared-context log-probs equal TRL's generic path (values and gradients) and the sampled log q
  (plain, reduced-vocabulary and padded-head drafters);
- per-position credit and advantages against a brute-force computation;
- what breaks PPOW's definitions is refused;
- `evaluate` logs eval_tau / eval_expected_accepted (usable as metric_for_best_model) and `train()` ends with a
  window rule calibrated on held-out data, which `save_model` writes.
"""

import itertools
import json
import math

import pytest
import torch
from datasets import Dataset

from ppow_trl.core.cost import CostModel, speedup
from ppow_trl.core.credit import per_position_advantages, per_position_credit
from ppow_trl.models import make_drafter
from ppow_trl.training.ppow_config import PPOWConfig
from ppow_trl.training.ppow_trainer import PPOWTrainer
from ppow_trl.core.rollout import draft_windows, positions_from_mask
from ppow_trl.core.windowing import AdaptiveWindowPolicy

from conftest import make_tiny_llama, make_tiny_tokenizer

GIVEN_COST = {"drafter_cost": 0.3, "verify_cost": [1.0, 1.4, 1.6, 1.8, 2.0]}


def responses(target, seed=0, count=8, prompt_length=(2, 6), new_tokens=12):
    """Target-sampled responses after prompts of different lengths (so contexts need left padding)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    prompts, outs = [], []
    for _ in range(count):
        length = int(torch.randint(prompt_length[0], prompt_length[1] + 1, (1,), generator=g))
        prompt = torch.randint(8, 64, (1, length), generator=g)
        out = target.generate(prompt, do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=0)
        prompts.append(prompt[0].tolist())
        outs.append(out[0, length:].tolist())
    return Dataset.from_dict({"prompt_ids": prompts, "response_ids": outs})


def config(tmp_path, **overrides):
    kwargs = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=16, num_generations=4, max_window=4,
                  max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                  disable_tqdm=True, selection_refresh_steps=5, seed=0, **GIVEN_COST)
    kwargs.update(overrides)
    return PPOWConfig(**kwargs)


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5)


def drafters(target):
    """name -> a fresh drafter: plain, reduced-vocabulary, and a head with 16 padding rows past the tokenizer."""
    padded = make_tiny_llama(vocab_size=80, num_layers=1, seed=3, initializer_range=0.5)
    return {
        "plain": lambda: make_tiny_llama(num_layers=1, seed=1, initializer_range=0.5),
        "reduced": lambda: make_drafter(target, num_layers=1, draft_vocab_ids=list(range(0, 64, 2)) + [3]),
        "padded": lambda: padded,
    }


def batch(trainer, rows):
    """One generation round (the selector replaces the rows' contexts by its own draw) and TRL's loss inputs."""
    trainer.model.train()
    out = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in rows])
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    return out, ids, mask


@pytest.mark.parametrize("kind", ["plain", "reduced", "padded"])
def test_training_log_probs_equal_the_sampled_log_q(tmp_path, target, kind):
    """What the loss differentiates is log q of the distribution the rollout sampled from (within 1e-4)."""
    trainer = PPOWTrainer(model=drafters(target)[kind](), target_model=target, args=config(tmp_path),
                          train_dataset=responses(target), processing_class=make_tiny_tokenizer())
    # contexts of different lengths, G windows each, in one micro-batch
    out, ids, mask = batch(trainer, [r for r in (0, 9, 30, 55) for _ in range(4)])
    assert len(set(map(len, trainer.context_pool.prompts))) > 1
    logps, entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, out["completion_ids"].shape[1],
                                                                   compute_entropy=True)
    w = trainer.last_window_rewards
    valid = w["window_mask"]
    assert torch.allclose(logps[valid], w["sampled_logq"][valid], atol=1e-4), (logps - w["sampled_logq"]).abs().max()
    assert (logps[~valid] == 0).all() and torch.isfinite(entropy).all()


@pytest.mark.parametrize("lora", [False, True])
def test_shared_context_path_equals_trl_path_in_values_and_gradients(tmp_path, target, lora):
    from peft import LoraConfig

    # float64, so that the comparison sees the paths and not float32 summation order (~1e-5 relative here)
    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5).double()
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) if lora else None
    trainer = PPOWTrainer(model=drafters(target)["plain"]().double(), target_model=target, args=config(tmp_path),
                          train_dataset=responses(target), processing_class=make_tiny_tokenizer(),
                          peft_config=peft_config)
    out, ids, mask = batch(trainer, [r for r in (3, 17, 40, 61) for _ in range(4)])
    width = out["completion_ids"].shape[1]
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    weights = torch.linspace(0.5, 1.5, out["completion_ids"].numel()).view_as(out["completion_ids"]).double()
    weights = weights * out["completion_mask"]  # a loss that weighs every token differently

    def run(shared: bool):
        trainer.args.shared_context_logprobs = shared
        logps, entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width,
                                                                       compute_entropy=True)
        return logps.detach(), torch.autograd.grad((logps * weights).sum(), params)

    def reference():
        """Plain float64: one full forward per row, log_softmax over the shared vocabulary."""
        start = ids.shape[1] - width
        logits = trainer.model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        logps = torch.log_softmax(logits[:, start - 1 : -1, :64], -1).gather(-1, ids[:, start:, None]).squeeze(-1)
        return logps.detach(), torch.autograd.grad((logps * weights).sum(), params)

    shared, generic, exact = run(True), run(False), reference()
    trainer.args.shared_context_logprobs = True
    valid = out["completion_mask"].bool()
    # Both paths use TRL's chunked kernel, which accumulates in float32: compare at float32 precision,
    # relative to the largest gradient entry.
    for arm in (shared, generic):
        assert torch.allclose(arm[0][valid].double(), exact[0][valid], atol=1e-6)
        for got, want in zip(arm[1], exact[1]):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert torch.allclose(shared[0][valid], generic[0][valid], atol=1e-6)
    for a, b in zip(shared[1], generic[1]):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_micro_batches_hold_whole_groups(tmp_path, target):
    """The buffered generation batch is shuffled group by group, so each context is computed once."""
    trainer = PPOWTrainer(model=drafters(target)["plain"](), target_model=target,
                          args=config(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2),
                          train_dataset=responses(target), processing_class=make_tiny_tokenizer())
    trainer.model.train()
    micro = trainer._prepare_inputs([trainer.train_dataset[i] for i in range(16)])
    assert len(trainer._buffered_inputs) == 2
    for chunk in trainer._buffered_inputs:
        keys = [tuple(row.tolist()) for row in chunk["prompt_ids"]]
        assert all(len(set(keys[g : g + 4])) == 1 for g in range(0, len(keys), 4))
    assert micro is trainer._buffered_inputs[0]


def brute_force_credit(prefix, prox, length, cost, weight):
    """C_k by definition: the reward of the window cut to L minus the reward of the window cut to k - 1."""
    def reward(n):  # speed of the first n tokens + lambda * (sum of the prox terms from k on) / L is not a cut;
        expected = sum(prefix[:n])
        return float(speedup(torch.tensor(expected), torch.tensor(n), cost)) if cost else expected + 1.0
    return [reward(length) - reward(k - 1) + weight * sum(prox[k - 1 : length]) / length for k in range(1, length + 1)]


def test_per_position_credit_and_advantages_against_brute_force():
    g = torch.Generator().manual_seed(0)
    cost = CostModel(**GIVEN_COST)
    rows, width, group = 12, 4, 4
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width) < lengths[:, None]
    alpha = torch.rand(rows, width, generator=g)
    prefix = alpha.cumprod(-1) * mask
    prox = torch.rand(rows, width, generator=g)
    for cost_model in (cost, None):
        credit = per_position_credit(prefix, prox, mask, cost_model, proximity_weight=0.5)
        for b in range(rows):
            want = brute_force_credit(prefix[b].tolist(), prox[b].tolist(), int(lengths[b]), cost_model, 0.5)
            assert credit[b, : int(lengths[b])].tolist() == pytest.approx(want, abs=1e-5)
            assert (credit[b, int(lengths[b]) :] == 0).all()
        # C_1 = R - 1: the first position carries the whole window reward
        window_reward = (speedup(prefix.sum(-1), lengths, cost_model) if cost_model else prefix.sum(-1) + 1) \
            + 0.5 * (prox * mask).sum(-1) / lengths
        assert torch.allclose(credit[:, 0], window_reward - 1, atol=1e-5)
    advantages = per_position_advantages(credit, mask, group)
    for start, k in itertools.product(range(0, rows, group), range(width)):
        members = [b for b in range(start, start + group) if lengths[b] > k]
        values = torch.tensor([float(credit[b, k]) for b in members])
        for b in range(start, start + group):
            got = float(advantages[b, k])
            if b not in members or len(members) < 2:
                assert got == 0.0
            else:
                want = (float(credit[b, k]) - values.mean()) / (values.std() + 1e-4)
                assert got == pytest.approx(float(want), abs=1e-4)


def test_a_position_few_windows_reach_is_not_credited_for_the_others_stopping():
    """The toy of issue 8: a 4th token with P(A >= 4) = 0.01, reached by one window of the group, gets 0 (not +1.47)."""
    prefix = torch.tensor([[0.9, 0.5, 0.1, 0.01], [0.9, 0.5, 0.1, 0.0], [0.8, 0.4, 0.0, 0.0], [0.7, 0.0, 0.0, 0.0]])
    mask = prefix > 0
    credit = per_position_credit(prefix, torch.zeros(4, 4), mask, None, 0.0)
    advantages = per_position_advantages(credit, mask, group_size=4)
    assert advantages[0, 3] == 0.0
    assert advantages[0, 2] > 0 > advantages[1, 2]  # two windows reach the 3rd token: it is compared between them


def test_refusals(tmp_path, target):
    with pytest.raises(ValueError, match="verify_temperature"):
        config(tmp_path, temperature=0.7, verify_temperature=1.0)
    config(tmp_path, temperature=0.7, verify_temperature=1.0, acceptance="greedy")  # greedy verification: no p at T
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        config(tmp_path, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ValueError, match="per_token_credit"):
        config(tmp_path, per_token_credit="sometimes")
    with pytest.raises(ValueError, match="calibration_regime"):
        config(tmp_path, calibration_regime="beam")
    trainer = PPOWTrainer(model=drafters(target)["plain"](), target_model=target,
                          args=config(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                                      steps_per_generation=4),
                          train_dataset=responses(target), processing_class=make_tiny_tokenizer())
    with pytest.raises(ValueError, match="Exact resume"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    with pytest.raises(ValueError, match="shared_context_logprobs"):
        PPOWTrainer(model=drafters(target)["padded"](), target_model=target,
                    args=config(tmp_path, shared_context_logprobs=False), train_dataset=responses(target),
                    processing_class=make_tiny_tokenizer())
    with pytest.raises(ValueError, match="peft_config"):  # TRL would reload the KL reference from _name_or_path
        PPOWTrainer(model=drafters(target)["plain"](), target_model=target, args=config(tmp_path, beta=0.1),
                    train_dataset=responses(target), processing_class=make_tiny_tokenizer())
    from peft import LoraConfig

    with pytest.raises(ValueError, match="lm_head"):  # TRL refuses it too; ours covers pre-wrapped PEFT drafters
        PPOWTrainer(model=drafters(target)["plain"](), target_model=target, args=config(tmp_path),
                    train_dataset=responses(target), processing_class=make_tiny_tokenizer(),
                    peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert config(tmp_path, load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"
                  ).metric_for_best_model == "eval_tau"


def test_model_level_checkpointing_falls_back_to_trls_path(tmp_path, target):
    """Checkpointed layers drop the KV cache in training: TRL's path runs (same values); a padded head is refused."""
    trainer = PPOWTrainer(model=drafters(target)["plain"](), target_model=target, args=config(tmp_path),
                          train_dataset=responses(target), processing_class=make_tiny_tokenizer())
    out, ids, mask = batch(trainer, [0] * 16)
    width = out["completion_ids"].shape[1]
    shared, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    trainer.model.gradient_checkpointing_enable()
    generic, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, width)
    valid = out["completion_mask"].bool()
    assert torch.allclose(shared[valid], generic[valid], atol=1e-5)
    padded = PPOWTrainer(model=drafters(target)["padded"](), target_model=target, args=config(tmp_path),
                         train_dataset=responses(target), processing_class=make_tiny_tokenizer())
    out, ids, mask = batch(padded, [0] * 16)
    padded.model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="activation checkpointing"):
        padded._get_per_token_logps_and_entropies(padded.model, ids, mask, out["completion_ids"].shape[1])


def test_greedy_drafting_follows_the_threshold(target):
    """Greedy windows stop where the policy's confidences say, not always at K (one-hot q would give conf = 1)."""
    drafter = drafters(target)["plain"]()
    contexts = [torch.tensor(c) for c in ([5, 9, 12], [20, 7], [33, 34, 35, 36])]
    lengths = {}
    for threshold in (0.0, 0.5, 1.0):
        policy = AdaptiveWindowPolicy(6, threshold)
        greedy = draft_windows(drafter, contexts, policy, temperature=0.0, vocab_size=64)
        lengths[threshold] = greedy.window_mask.sum(-1)
        assert torch.equal(lengths[threshold], policy.window_lengths(greedy.confidences))
        assert (greedy.confidences < 1).all()
    assert (lengths[0.0] == 6).all() and (lengths[1.0] == 1).all()
    assert (lengths[0.5] < 6).any()


def test_evaluate_logs_held_out_tau_and_train_ends_calibrated(tmp_path, target):
    data, held_out = responses(target, seed=0, count=8), responses(target, seed=5, count=4)
    args = config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                  metric_for_best_model="eval_tau", greater_is_better=True, load_best_model_at_end=True,
                  eval_max_new_tokens=10, calibration_contexts_per_response=3, calibration_regime="both")
    trainer = PPOWTrainer(model=drafters(target)["plain"](), target_model=target, args=args, train_dataset=data,
                          eval_dataset=held_out, processing_class=make_tiny_tokenizer())
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_tau" in h]
    assert [h["step"] for h in evals] == [2, 4]
    for h in evals:
        assert 1.0 <= h["eval_tau"] <= 5.0 and 1.0 <= h["eval_tau_fixed_window"] <= 5.0
        assert 0.0 <= h["eval_expected_accepted"] <= 4.0 and h["eval_simulated_speedup"] > 0
        assert 1 <= h["eval_window_max"] <= 4 and math.isfinite(h["eval_predicted_speedup"])
    assert trainer.state.best_metric == max(h["eval_tau"] for h in evals)
    policy = trainer.window_policy
    assert policy.calibration["regime"] == "both" and policy.calibration["num_contexts"] == 12
    assert trainer.rollout_policy == AdaptiveWindowPolicy(4, 0.0)  # training rollouts keep the configured rule
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "ppow_window_policy.json").read_text())
    assert saved["max_window"] == policy.max_window and saved["calibration"]["regime"] == "both"
    assert AdaptiveWindowPolicy.from_pretrained(tmp_path / "saved") == policy


def test_without_held_out_data_the_configured_rule_is_kept(tmp_path, target, caplog):
    trainer = PPOWTrainer(model=drafters(target)["plain"](), target_model=target,
                          args=config(tmp_path, max_steps=1, window_threshold=0.3), train_dataset=responses(target),
                          processing_class=make_tiny_tokenizer())
    trainer.train()
    assert trainer.window_policy == AdaptiveWindowPolicy(4, 0.3)
    assert "not calibrated" in caplog.text
