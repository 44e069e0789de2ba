"""KD baseline: top-k forward KL of a drafter against cached target distributions (`ppow_trl.training.kd_trainer`)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_tokenizer
from datasets import Dataset
from transformers import AutoModelForCausalLM, set_seed

from ppow_trl.data import build_target_responses, compute_target_topk
from ppow_trl.drafter import PPOWDrafterForCausalLM
from ppow_trl.training.kd_trainer import DataCollatorForKD, KDConfig, KDTrainer, topk_forward_kl, topk_total_variation
from ppow_trl.models import build_draft_vocab, make_drafter

VOCAB = 64
EOS = 3


@pytest.fixture(scope="module")
def setup():
    """A tiny target with non-degenerate distributions, its sampled responses and their top-8 / top-64."""
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5)
    words = [" ".join(f"w{1 + (i * 7 + j) % 55}" for j in range(2 + i % 5)) for i in range(16)]
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": text}]} for i, text in enumerate(words)]
    responses = build_target_responses(
        target, tokenizer, Dataset.from_list(rows), max_new_tokens=12, batch_size=8, do_sample=True, seed=0
    )
    topk = compute_target_topk(target, responses, top_k=8)
    full = compute_target_topk(target, responses, top_k=VOCAB)
    return {"tokenizer": tokenizer, "target": target, "responses": responses, "topk": topk, "full": full}


def _config(tmp_path, **kwargs) -> KDConfig:
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        max_steps=1,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        logging_steps=10,
    )
    return KDConfig(**{**defaults, **kwargs})


def _trainer(model, setup, tmp_path, dataset: str = "topk", peft_config=None, **config) -> KDTrainer:
    return KDTrainer(
        model,
        _config(tmp_path, **config),
        train_dataset=setup[dataset],
        processing_class=setup["tokenizer"],
        peft_config=peft_config,
    )


def _evaluate(trainer: KDTrainer, dataset: Dataset) -> tuple[float, float]:
    metrics = trainer.evaluate(eval_dataset=dataset)
    return metrics["eval_kd/kl"], metrics["eval_kd/top1_agreement"]


def _brute_force_kl(model, batch, draft_ids, temperature: float, tail_bucket: bool) -> float:
    """Mean per-token KL from the formula, position by position, in float64 on the full-width softmax.

    `draft_ids`: the ids the drafter can output (None: all). The full-width logits of a reduced-vocabulary
    drafter are -inf outside them, so their q is exactly 0.
    """
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
    total, count = 0.0, 0
    for row in range(logits.shape[0]):
        for position in batch["completion_mask"][row].nonzero().flatten().tolist():
            q = torch.softmax(logits[row, position] / temperature, dim=-1)
            ids = batch["teacher_topk_ids"][row, position].tolist()
            logprobs = batch["teacher_topk_logprobs"][row, position].double().tolist()
            kept = [(i, lp) for i, lp in zip(ids, logprobs) if draft_ids is None or i in draft_ids]
            kl = 0.0
            if tail_bucket:
                p = [math.exp(lp) for _, lp in kept]
                q_in = [q[i].item() for i, _ in kept]
                for p_j, q_j in zip(p, q_in):
                    kl += p_j * math.log(p_j / q_j)
                p_tail, q_tail = 1.0 - sum(p), 1.0 - sum(q_in)
                if p_tail > 1e-6:
                    kl += p_tail * math.log(p_tail / q_tail)
            elif kept:
                norm = sum(math.exp(lp) for _, lp in kept)
                for i, lp in kept:
                    p_j = math.exp(lp) / norm
                    kl += p_j * math.log(p_j / q[i].item())
            total, count = total + kl, count + 1
    return total / count


def _batch(trainer: KDTrainer, dataset: Dataset, indices=(0, 6, 7, 3, 10)):
    """A padded batch whose prompts and responses have different lengths (index 7 has a 2-token response)."""
    return trainer.data_collator([dataset[i] for i in indices])


# ------------------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("tail_bucket", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_loss_equals_brute_force(setup, tmp_path, tail_bucket, temperature):
    drafter = make_tiny_llama(num_layers=1, seed=1)
    trainer = _trainer(drafter, setup, tmp_path, tail_bucket=tail_bucket, temperature=temperature)
    batch = _batch(trainer, setup["topk"])
    loss = trainer.compute_loss(drafter, batch)
    expected = _brute_force_kl(drafter, batch, None, temperature, tail_bucket)
    assert expected > 0.1
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_loss_is_zero_when_the_drafter_is_the_target(setup, tmp_path):
    """k = vocabulary size: the teacher's top-k is its whole distribution, which the target matches exactly."""
    target = setup["target"]
    for tail_bucket in (True, False):
        trainer = _trainer(target, setup, tmp_path, dataset="full", tail_bucket=tail_bucket)
        target.zero_grad()
        loss = trainer.compute_loss(target, _batch(trainer, setup["full"]))
        assert abs(loss.item()) < 1e-6
        loss.backward()  # the drafter's rest class is empty here: its logsumexp over nothing must not give NaN
        # Every parameter gets a finite gradient (none left out of the graph); at this optimum it may be ~0.
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in target.parameters())
        # Away from the optimum (drafter softmax at temperature 2, the teacher's at 1), still with an empty rest
        # class: a loss > 0 whose gradient reaches every parameter, finite and non-zero.
        trainer = _trainer(target, setup, tmp_path, dataset="full", tail_bucket=tail_bucket, temperature=2.0)
        target.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(target, _batch(trainer, setup["full"]))
        assert loss.item() > 1e-3
        loss.backward()
        for name, p in target.named_parameters():
            assert p.requires_grad and p.grad is not None, name
            assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    target.zero_grad()


def test_topk_forward_kl_edge_cases():
    """Out-of-vocabulary teacher ids, a support covering every column, and rows with nothing in the vocabulary."""
    logits = torch.randn(3, 4, requires_grad=True)
    id_to_column = torch.tensor([0, 1, -1, 2, 3, -1])  # ids 2 and 5 are outside the drafter's vocabulary
    ids = torch.tensor([[0, 2], [0, 1], [2, 5]])
    logprobs = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.1], [0.7, 0.2]]))
    q = torch.softmax(logits.detach().double(), dim=-1)

    with_tail = topk_forward_kl(logits, ids, logprobs, id_to_column, tail_bucket=True)
    # Row 0: id 2 is OOV, so its 0.3 joins the rest: p = (0.5, 0.5), q = (q0, 1 - q0).
    expected0 = 0.5 * math.log(0.5 / q[0, 0]) + 0.5 * math.log(0.5 / (1 - q[0, 0]))
    expected1 = 0.6 * math.log(0.6 / q[1, 0]) + 0.1 * math.log(0.1 / q[1, 1])
    expected1 += 0.3 * math.log(0.3 / (1 - q[1, :2].sum()))
    assert with_tail.tolist() == pytest.approx([expected0, expected1, 0.0], rel=1e-5, abs=1e-6)

    without_tail = topk_forward_kl(logits, ids, logprobs, id_to_column, tail_bucket=False)
    p1 = torch.tensor([0.6, 0.1]) / 0.7
    expected1 = (p1[0] * math.log(p1[0] / q[1, 0]) + p1[1] * math.log(p1[1] / q[1, 1])).item()
    assert without_tail.tolist() == pytest.approx([-math.log(q[0, 0]), expected1, 0.0], rel=1e-5, abs=1e-6)

    # Every column in the support while the teacher keeps mass elsewhere: finite (the rest is floored), no NaN.
    all_columns = topk_forward_kl(logits[:1], torch.tensor([[0, 1, 2, 3]]), torch.log(torch.full((1, 4), 0.2)))
    assert torch.isfinite(all_columns).all() and all_columns.item() > 0.2 * 80
    (with_tail.sum() + without_tail.sum() + all_columns.sum()).backward()
    assert torch.isfinite(logits.grad).all()


def test_collator_aligns_and_truncates():
    collator = DataCollatorForKD(pad_token_id=0, max_length=7)
    rows = [
        {
            "prompt_ids": [11, 12, 13, 14, 15, 16],
            "response_ids": [21, 22, 23, 24],
            "topk_ids": [[21, 1], [22, 1], [23, 1], [24, 1]],
            "topk_logprobs": [[-0.1, -3.0]] * 4,
        },
        {"prompt_ids": [31, 32], "response_ids": [41], "topk_ids": [[41, 2]], "topk_logprobs": [[-0.2, -2.0]]},
        {
            "prompt_ids": [51],
            "response_ids": list(range(60, 70)),
            "topk_ids": [[i, 3] for i in range(60, 70)],
            "topk_logprobs": [[-0.3, -1.5]] * 10,
        },
    ]
    batch = collator(rows)
    # Row 0 keeps the last 3 prompt tokens; row 2 keeps its only prompt token and its first 6 response tokens.
    assert batch["input_ids"].tolist() == [
        [14, 15, 16, 21, 22, 23, 24],
        [31, 32, 41, 0, 0, 0, 0],
        [51, 60, 61, 62, 63, 64, 65],
    ]
    assert batch["attention_mask"].sum(dim=1).tolist() == [7, 3, 7]
    assert batch["completion_mask"].long().tolist() == [
        [0, 0, 1, 1, 1, 1, 0],
        [0, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 1, 0],
    ]
    # The teacher row at each predicting position names the next input token; labels mark the response tokens.
    for row in range(3):
        positions = batch["completion_mask"][row].nonzero().flatten()
        assert torch.equal(batch["teacher_topk_ids"][row, positions, 0], batch["input_ids"][row, positions + 1])
        assert torch.equal((batch["labels"][row] != -100).nonzero().flatten(), positions + 1)
    assert batch["teacher_topk_logprobs"].shape == (3, 7, 2)


# ------------------------------------------------------------------------------------------------- training


def test_training_lowers_kl_and_raises_top1_agreement(setup, tmp_path):
    set_seed(0)
    drafter = make_drafter(setup["target"], num_layers=1)
    trainer = _trainer(drafter, setup, tmp_path, max_steps=40)
    kl_before, top1_before = _evaluate(trainer, setup["topk"])
    trainer.train()
    kl_after, top1_after = _evaluate(trainer, setup["topk"])
    # Measured: KL 1.40 -> 0.13, top-1 agreement 0.27 -> 0.87.
    assert kl_after < 0.5 * kl_before
    assert top1_after > top1_before + 0.3
    logged = [entry for entry in trainer.state.log_history if "kd/kl" in entry]
    assert logged and all(0.0 <= entry["kd/top1_agreement"] <= 1.0 for entry in logged)
    assert logged[-1]["kd/kl"] < logged[0]["kd/kl"]

    trainer.save_model(str(tmp_path / "full"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))
    assert torch.equal(reloaded.lm_head.weight, drafter.lm_head.weight)


def test_gradient_accumulation_weights_tokens_like_one_batch(setup, tmp_path):
    """Two micro-batches of 4 give the same update as one batch of 8 (normalised by all response tokens)."""
    data = setup["topk"].select(range(8))
    updated = []
    for batch_size, steps in ((8, 1), (4, 2)):
        set_seed(0)
        drafter = make_tiny_llama(num_layers=1, seed=1)
        config = _config(
            tmp_path,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=steps,
            optim="sgd",
            lr_scheduler_type="constant",
            max_grad_norm=0.0,
        )
        KDTrainer(drafter, config, train_dataset=data, processing_class=setup["tokenizer"]).train()
        updated.append(drafter.lm_head.weight.detach().clone())
    # A per-micro-batch mean would differ by ~5e-5 here (the batches hold different numbers of response tokens).
    torch.testing.assert_close(updated[0], updated[1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tail_bucket", [True, False])
def test_reduced_vocabulary_drafter(setup, tmp_path, tail_bucket):
    draft_ids = build_draft_vocab(setup["topk"]["response_ids"], size=40, vocab_size=VOCAB, always_include=[EOS])
    drafter = make_drafter(setup["target"], num_layers=1, draft_vocab_ids=draft_ids)
    assert isinstance(drafter, PPOWDrafterForCausalLM)
    trainer = _trainer(drafter, setup, tmp_path, max_steps=30, tail_bucket=tail_bucket)
    batch = _batch(trainer, setup["topk"])
    outside = ~torch.isin(batch["teacher_topk_ids"][batch["completion_mask"]], draft_ids)
    assert outside.any()  # some teacher mass lies outside the draft vocabulary
    loss = trainer.compute_loss(drafter, batch)
    expected = _brute_force_kl(drafter, batch, set(draft_ids.tolist()), 1.0, tail_bucket)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(expected, rel=1e-5)

    kl_before, top1_before = _evaluate(trainer, setup["topk"])
    trainer.train()
    kl_after, top1_after = _evaluate(trainer, setup["topk"])
    assert kl_after < 0.7 * kl_before and top1_after > top1_before + 0.2


def test_lora_trains_only_the_adapter(setup, tmp_path):
    from peft import LoraConfig, PeftModel

    draft_ids = build_draft_vocab(setup["topk"]["response_ids"], size=40, vocab_size=VOCAB, always_include=[EOS])
    drafter = make_drafter(setup["target"], num_layers=1, draft_vocab_ids=draft_ids)
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    modules = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=modules, task_type="CAUSAL_LM")
    trainer = _trainer(drafter, setup, tmp_path, peft_config=lora, max_steps=15, learning_rate=2e-2)
    assert isinstance(trainer.model, PeftModel)
    kl_before, _ = _evaluate(trainer, setup["topk"])
    trainer.train()
    kl_after, _ = _evaluate(trainer, setup["topk"])
    assert kl_after < kl_before

    # lora_B starts at zero: it moved; every other weight (the reduced head included) did not.
    assert any("lora_B" in name and value.abs().sum() > 0 for name, value in trainer.model.named_parameters())
    base = trainer.model.get_base_model()
    for name, value in base.state_dict().items():
        if "lora_" not in name:
            original = name.replace(".base_layer", "")
            assert torch.equal(value, before[original]), name

    trainer.save_model(str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").exists()


# ------------------------------------------------------------------------------------------------- bad input


def test_dataset_without_topk_columns_is_rejected(setup, tmp_path):
    drafter = make_tiny_llama(num_layers=1, seed=1)
    with pytest.raises(ValueError, match="compute_target_topk"):
        KDTrainer(drafter, _config(tmp_path), train_dataset=setup["responses"], processing_class=setup["tokenizer"])
    with pytest.raises(ValueError, match="compute_target_topk"):
        DataCollatorForKD()([setup["responses"][0]])
    with pytest.raises(ValueError, match="temperature"):
        _config(tmp_path, temperature=0.0)


# ------------------------------------------------------------------------------------------- TV (direct acceptance)


def test_topk_total_variation_matches_brute_force():
    """Full top-k: 1 - sum_v min(p, q) exactly; truncated top-k with the rest class: the coarse-grained TV."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 10, generator=g) * 2
    p = torch.softmax(torch.randn(5, 10, generator=g) * 2, -1)
    q = torch.softmax(logits.double(), -1)
    logp, ids = p.log().sort(-1, descending=True)
    full = topk_total_variation(logits, ids, logp)
    assert torch.allclose(full.double(), 1 - torch.minimum(p.double(), q).sum(-1), atol=1e-6)
    k = 3
    top, rest = ids[:, :k], ids[:, k:]
    p_top, q_top = p.double().gather(-1, top), q.gather(-1, top)
    coarse = 1 - torch.minimum(p_top, q_top).sum(-1) - torch.minimum(1 - p_top.sum(-1), q.gather(-1, rest).sum(-1))
    assert torch.allclose(topk_total_variation(logits, top, logp[:, :k]).double(), coarse, atol=1e-6)
    no_tail = topk_total_variation(logits, top, logp[:, :k], tail_bucket=False).double()
    assert torch.allclose(no_tail, 1 - torch.minimum(p_top, q_top).sum(-1), atol=1e-6)
    # Lower and upper bounds of the true TV.
    true_tv = 1 - torch.minimum(p.double(), q).sum(-1)
    assert (coarse <= true_tv + 1e-9).all() and (no_tail >= true_tv - 1e-6).all()
    # A reduced head: ids the drafter cannot output have q = 0.
    id_to_column = torch.tensor([0, 1, 2, 3, 4, -1, -1, -1, -1, -1])
    reduced = topk_total_variation(logits[:, :5], ids, logp, id_to_column)
    q5 = torch.softmax(logits[:, :5].double(), -1)
    expected = 1 - torch.minimum(p.double()[:, :5], q5).sum(-1)
    assert torch.allclose(reduced.double(), expected, atol=1e-6)


def test_tv_training_raises_the_acceptance_rate(setup, tmp_path):
    """loss='tv' lowers the held-out TV (the one-token rejection rate) and logs kd/tv."""
    set_seed(0)
    drafter = make_drafter(setup["target"], num_layers=1)
    trainer = _trainer(drafter, setup, tmp_path, max_steps=40, loss="tv", dataset="full")
    before = trainer.evaluate(eval_dataset=setup["full"])["eval_kd/tv"]
    trainer.train()
    after = trainer.evaluate(eval_dataset=setup["full"])["eval_kd/tv"]
    assert after < 0.6 * before
    assert trainer.trained_positions == sum(len(r) for r in setup["full"]["response_ids"]) * 40 // 2
    with pytest.raises(ValueError, match="loss must be"):
        _config(tmp_path, loss="kl")


# ------------------------------------------------------------------------------------------ eval_tau, early stopping


def test_eval_tau_is_exact_greedy_tau_on_the_eval_responses(setup, tmp_path):
    """eval_tau = tokens / rounds of exact_greedy_tau over the eval prompts, with their responses as the target's
    greedy text: checked against the live loop's output of each prompt."""
    from ppow_trl.serving.generation import speculative_generate
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    target, tokenizer = setup["target"], setup["tokenizer"]
    greedy = build_target_responses(target, tokenizer, Dataset.from_list(
        [{"id": f"e{i}", "messages": [{"role": "user", "content": f"w{i} w{i + 3}"}]} for i in range(5)]),
        max_new_tokens=10, batch_size=8, do_sample=False)
    drafter = make_tiny_llama(num_layers=1, seed=3)
    trainer = KDTrainer(drafter, _config(tmp_path, eval_tau_window=3, eval_max_new_tokens=10),
                        train_dataset=setup["topk"], eval_dataset=greedy, processing_class=tokenizer, target=target)
    tau = trainer.evaluate()["eval_tau"]
    tokens = rounds = 0
    for prompt in greedy["prompt_ids"]:
        out = speculative_generate(target, drafter, torch.tensor([prompt]), policy=AdaptiveWindowPolicy(3, 0.0),
                                   max_new_tokens=10)
        tokens, rounds = tokens + len(out.new_tokens), rounds + out.num_rounds
    assert tau == pytest.approx(tokens / rounds)


def test_early_stopping_on_eval_tau_stops_when_tau_stops_rising(setup, tmp_path):
    from transformers import EarlyStoppingCallback

    target, tokenizer = setup["target"], setup["tokenizer"]
    # a learning rate too small to change the greedy drafts: eval_tau never improves after the first evaluation
    args = _config(tmp_path, eval_tau_window=2, eval_max_new_tokens=12, learning_rate=1e-12, max_steps=20,
                   eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                   load_best_model_at_end=True, metric_for_best_model="eval_tau", per_device_train_batch_size=4)
    trainer = KDTrainer(make_tiny_llama(num_layers=1, seed=3), args, train_dataset=setup["topk"],
                        eval_dataset=setup["responses"], processing_class=tokenizer, target=target,
                        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)])
    trainer.train()
    evaluations = [row["eval_tau"] for row in trainer.state.log_history if "eval_tau" in row]
    assert trainer.state.global_step == 6 and len(evaluations) == 3 and len(set(evaluations)) == 1


def test_eval_tau_needs_the_target(setup, tmp_path):
    with pytest.raises(ValueError, match="eval_tau_window > 0 measures exact greedy tau against the target"):
        KDTrainer(make_tiny_llama(num_layers=1, seed=3), _config(tmp_path, eval_tau_window=2),
                  train_dataset=setup["topk"], eval_dataset=setup["responses"], processing_class=setup["tokenizer"])


# ------------------------------------------------------------------------------------------ throughput options


def test_bf16_autocast_keeps_the_loss_and_still_learns(setup, tmp_path):
    set_seed(0)
    drafter = make_drafter(setup["target"], num_layers=1)
    trainer = _trainer(drafter, setup, tmp_path, max_steps=40, bf16_autocast=True)
    batch = _batch(trainer, setup["topk"])
    fp32 = _trainer(drafter, setup, tmp_path).compute_loss(drafter, batch).item()
    assert trainer.compute_loss(drafter, batch).item() == pytest.approx(fp32, rel=0.05)  # bf16 matmuls, fp32 loss
    kl_before, top1_before = _evaluate(trainer, setup["topk"])
    trainer.train()
    kl_after, top1_after = _evaluate(trainer, setup["topk"])
    assert kl_after < 0.5 * kl_before and top1_after > top1_before + 0.3  # as in fp32 (test above)
    assert all(p.dtype == torch.float32 for p in drafter.parameters())  # weights and optimizer stay fp32


def test_group_by_length_batches_sequences_of_similar_length(setup, tmp_path):
    drafter = make_tiny_llama(num_layers=1, seed=1)
    trainer = _trainer(drafter, setup, tmp_path, per_device_train_batch_size=4,
                       train_sampling_strategy="group_by_length")
    lengths = [len(p) + len(r) for p, r in zip(setup["topk"]["prompt_ids"], setup["topk"]["response_ids"])]
    assert trainer.train_dataset["length"] == lengths
    padded = sum(batch["input_ids"].numel() for batch in trainer.get_train_dataloader())
    shuffled = _trainer(drafter, setup, tmp_path, per_device_train_batch_size=4)
    assert "length" not in shuffled.train_dataset.column_names
    # grouped: every batch pads to about its own longest sequence, so fewer positions than a random draw's
    assert padded < sum(batch["input_ids"].numel() for batch in shuffled.get_train_dataloader())
    assert _evaluate(trainer, setup["topk"])[0] > 0  # evaluation batches by length too (its rows get lengths)
