"""DFlash block drafters (ppow_trl.drafters.dflash): transformers' own MuseGlimmerAssistantModel as the drafter, the anchored
block forward equal to the cached one, KD on anchored blocks, losslessness in our loop and in transformers' native
``speculation_type="dflash"`` route (with our adaptive window), exact greedy tau, rollouts and PPOW log-probs, export."""

from __future__ import annotations

import pytest
import torch
from conftest import make_bigram_llama, make_tiny_llama, make_tiny_tokenizer, tiny_word_responses
from scipy.stats import chisquare
from transformers import AutoModel, MuseGlimmerAssistantModel, set_seed
from transformers.cache_utils import DFlashCache

from ppow_trl.data import compute_target_topk
from ppow_trl.drafters.dflash import anchored_block_hidden, dflash_from_target, feature_layers
from ppow_trl.drafters.eagle3 import target_features
from ppow_trl.serving.generation import exact_greedy_tau, speculative_generate
from ppow_trl.training.kd_trainer import KDConfig, KDTrainer
from ppow_trl.core.windowing import AdaptiveWindowPolicy

LAYERS = [0, 1, 3]  # decoder layers: hidden states 1, 2, 4
MASK_ID = 6  # "system": never in the tiny data (user prompts only)
BLOCK = 5


def test_anchored_blocks_equal_the_cached_rounds():
    """Many blocks in one masked forward equal transformers' cached rounds: DFlashCache over growing contexts, one
    block per round, as DFlashTokenCandidateGenerator runs them."""
    target = make_tiny_llama(num_layers=4, seed=0)
    drafter = dflash_from_target(target, mask_token_id=MASK_ID, block_size=BLOCK, target_layer_ids=LAYERS,
                                 num_hidden_layers=2, seed=1).eval()
    assert feature_layers(drafter) == [1, 2, 4]
    sequence = torch.randint(8, 60, (1, 20), generator=torch.Generator().manual_seed(0))
    features = target_features(target, sequence, layer_ids=feature_layers(drafter))
    embed = target.get_input_embeddings()
    anchors = torch.tensor([[3, 7, 8, 15]])
    with torch.no_grad():
        batched = anchored_block_hidden(drafter, embed, features[:, :19], sequence[:, anchors[0]], anchors)
        cache, seen = DFlashCache(config=drafter.config), 0
        for index, anchor in enumerate(anchors[0].tolist()):
            noise = torch.tensor([[int(sequence[0, anchor])] + [MASK_ID] * (BLOCK - 1)])
            if seen:
                cache.crop(-BLOCK)
            cache.set_previous_accepted_tokens(anchor - seen)
            positions = torch.arange(seen, anchor + BLOCK)[None]
            out = drafter(noise_embeds=embed(noise), context_hidden_states=features[:, seen:anchor],
                          position_ids=positions, cache=cache)
            seen = anchor
            torch.testing.assert_close(out.last_hidden_state[0], batched[0, index], atol=1e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A KD (anchored blocks) DFlash drafter of a tiny Llama (300 steps), its data."""
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_llama(num_layers=4, seed=0, initializer_range=0.5)
    responses = tiny_word_responses(target, tokenizer)
    topk = compute_target_topk(target, responses, top_k=8)
    set_seed(0)
    drafter = dflash_from_target(target, mask_token_id=MASK_ID, block_size=BLOCK, target_layer_ids=LAYERS).train()
    args = KDConfig(output_dir=str(tmp_path_factory.mktemp("kd")), per_device_train_batch_size=8, max_steps=300,
                    learning_rate=1e-2, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                    logging_steps=20, block_anchors=8)
    trainer = KDTrainer(drafter, args, train_dataset=topk, processing_class=tokenizer, target=target)
    before = trainer.evaluate(eval_dataset=topk)
    trainer.train()
    after = trainer.evaluate(eval_dataset=topk)
    return {"target": target, "drafter": drafter.eval(), "tokenizer": tokenizer, "responses": responses, "topk": topk,
            "before": before, "after": after}


def test_kd_on_anchored_blocks_learns_every_slot(trained):
    before, after = trained["before"], trained["after"]
    # Measured: KL 13.5 -> 0.25 and top-1 agreement 0.02 -> 0.85 at slot 1; slots 2-4 alike (0.22-0.28, 0.83-0.87).
    for suffix in ("", "_step1", "_step2", "_step3"):
        assert after[f"eval_kd/kl{suffix}"] < 0.5 * before[f"eval_kd/kl{suffix}"]
        assert after[f"eval_kd/top1_agreement{suffix}"] > before[f"eval_kd/top1_agreement{suffix}"] + 0.2


def test_one_drafter_forward_per_round_and_at_most_a_block(trained):
    """(Losslessness and exact tau for every family: test_families.py.) A block drafts its whole window in one
    forward, and a window longer than the block's slots is refused."""
    target, drafter = trained["target"], trained["drafter"]
    policy = AdaptiveWindowPolicy(max_window=4, threshold=0.0)
    for prompt in trained["responses"]["prompt_ids"][:3]:
        prompt = torch.tensor([prompt])
        out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=16, eos_token_id=[])
        assert out.drafter_forwards == sum(1 for d in out.drafted_per_round if d)  # one forward per round
        assert sum(out.accepted_per_round) > 0
    with pytest.raises(ValueError, match="block_size - 1"):
        speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(BLOCK), max_new_tokens=4)


def test_ppow_trains_a_block_drafter_with_the_sampled_log_probs(trained, tmp_path):
    """The loss recomputes each context's block once, with gradients: its log q equals the rollout's sampled log q
    within 1e-4; LoRA training then runs end to end, and the cost model charges one drafter forward per round."""
    from peft import LoraConfig

    from ppow_trl.training.ppow_config import PPOWConfig
    from ppow_trl.training.ppow_trainer import PPOWTrainer

    target, data = trained["target"], trained["responses"]
    trained["drafter"].save_pretrained(tmp_path / "warm")
    drafter = AutoModel.from_pretrained(tmp_path / "warm").train()
    assert isinstance(drafter, MuseGlimmerAssistantModel)
    args = PPOWConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_window=4,
                      max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True, selection_refresh_steps=5, seed=0, drafter_cost=0.3,
                      verify_cost=[1.0, 1.4, 1.6, 1.8, 2.0])
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                         "down_proj", "fc"])
    trainer = PPOWTrainer(model=drafter, target_model=target, args=args, train_dataset=data, eval_dataset=data,
                          processing_class=trained["tokenizer"], peft_config=lora)
    assert trainer.cost_model.drafter_per_round
    lengths = torch.tensor([0, 1, 4])
    torch.testing.assert_close(trainer.cost_model.round_time(lengths), torch.tensor([1.0, 1.7, 2.3]))
    trainer.model.train()
    inputs = [trainer.train_dataset[i] for i in [0, 0, 0, 0, 5, 5, 5, 5]]
    out = trainer._generate_and_score_completions(inputs)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, out["completion_ids"].shape[1])
    w = trainer.last_window_rewards
    valid = w["window_mask"]
    assert valid.sum() > 8
    assert torch.allclose(logps[valid], w["sampled_logq"][valid], atol=1e-4), (logps - w["sampled_logq"]).abs().max()
    logps.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in trainer.model.named_parameters()
               if "lora_" in n)
    trainer.model.zero_grad()
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_tau"] >= 1.0


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_native_route_is_lossless_with_the_adaptive_window(trained, tmp_path, threshold):
    """target.generate(assistant_model=drafter, speculation_type="dflash"): stock transformers (AutoModel, no hook)
    and load_assistant's adaptive window both reproduce plain greedy; with the hook each round's window is the
    policy's rule on the block our session drafts after the same committed prefix."""
    from ppow_trl.serving.assisted import load_assistant, save_assistant
    from ppow_trl.drafting import drafting_session

    target, drafter = trained["target"], trained["drafter"]
    policy = AdaptiveWindowPolicy(max_window=4, threshold=threshold)
    save_assistant(drafter, tmp_path / "drafter", policy=policy, tokenizer=trained["tokenizer"])
    stock = AutoModel.from_pretrained(tmp_path / "drafter")
    assert type(stock) is MuseGlimmerAssistantModel and not hasattr(stock, "_ppow_block_window")
    with pytest.raises(ValueError, match="target=target"):
        load_assistant(tmp_path / "drafter")
    adaptive = load_assistant(tmp_path / "drafter", target=target)
    window = adaptive._ppow_block_window
    for prompt in trained["responses"]["prompt_ids"][:4]:
        prompt = torch.tensor([prompt])
        kwargs = dict(do_sample=False, max_new_tokens=14, pad_token_id=0, eos_token_id=None,
                      attention_mask=torch.ones_like(prompt))
        plain = target.generate(prompt, **kwargs)
        assert torch.equal(target.generate(prompt, assistant_model=stock, speculation_type="dflash", **kwargs), plain)
        window.window_lengths.clear(), window.anchors.clear()
        assert torch.equal(target.generate(prompt, assistant_model=adaptive, speculation_type="dflash", **kwargs), plain)
        # what the rule picks after prompt + text[:s], from our session's block (teacher forced, exact for blocks)
        text = plain[0, prompt.shape[1]:].tolist()
        session = drafting_session(drafter, target)
        features = target_features(target, plain, layer_ids=session.target_layer_ids)[0]
        confidences = torch.stack([policy.confidence(logits) for _, logits in
                                   session.teacher_forced_logits(prompt[0].tolist(), text, policy.max_window, features)], 1)
        expected = policy.window_lengths(confidences).tolist()
        assert len(window.anchors) > 1
        for anchor, length in zip(window.anchors, window.window_lengths):
            assert length == expected[anchor + 1 - prompt.shape[1]]
    if threshold > 0:
        assert min(window.window_lengths) < policy.max_window  # the rule cut some windows


def test_native_route_sampling_matches_target_distribution():
    """Chi-square through target.generate(assistant_model=drafter, speculation_type="dflash", do_sample=True) with
    the adaptive window and an untrained (often rejected) drafter: the first two new tokens follow the target's
    own law (bigram target, vocabulary 4)."""
    from ppow_trl.drafters.dflash.assisted import attach_block_window

    vocab, prompt = 4, torch.tensor([[1, 2, 3]])
    g = torch.Generator().manual_seed(0)
    target = make_bigram_llama(torch.randn(vocab, vocab, generator=g) * 1.2, num_layers=2)
    target.generation_config.pad_token_id = 0
    drafter = dflash_from_target(target, mask_token_id=0, block_size=4, target_layer_ids=[0, 1], seed=3).eval()
    window = attach_block_window(drafter, target, AdaptiveWindowPolicy(3, 0.3))
    with torch.no_grad():
        step = torch.softmax(target(torch.arange(vocab)[None]).logits[0], -1)
        first = torch.softmax(target(prompt).logits[0, -1], -1)
    expected = (first[:, None] * step).flatten().double()
    counts = torch.zeros(vocab * vocab, dtype=torch.double)
    torch.manual_seed(5)
    samples = 600
    for _ in range(samples):
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), assistant_model=drafter,
                              speculation_type="dflash", do_sample=True, top_k=0, max_new_tokens=3, eos_token_id=None)
        counts[int(out[0, 3]) * vocab + int(out[0, 4])] += 1
    assert window.window_lengths and min(window.window_lengths) < 3  # the rule cut the block (K = 3)
    window.remove()
    _, p_value = chisquare(counts.numpy(), (expected / expected.sum() * samples).numpy())
    assert p_value > 1e-3


@pytest.mark.parametrize("layout", ["zlab", "speculators"])
def test_export_round_trips_the_block_logits(trained, tmp_path, layout):
    """export_dflash -> import_dflash gives the same block logits; the files have the engines' names and ids."""
    import json

    from ppow_trl.drafters.dflash import detect_dflash_format, export_dflash, import_dflash
    from safetensors.torch import load_file

    target, drafter = trained["target"], trained["drafter"]
    export_dflash(drafter, tmp_path, format=layout, target=target)
    config = json.loads((tmp_path / "config.json").read_text())
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= keys
    assert not any(k.startswith("encoder.") for k in keys)
    if layout == "zlab":
        assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
        assert config["dflash_config"]["target_layer_ids"] == LAYERS and config["dflash_config"]["mask_token_id"] == MASK_ID
        assert config["is_causal"] is False and "lm_head.weight" not in keys
    else:
        assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in LAYERS] and "lm_head.weight" in keys
    assert detect_dflash_format(tmp_path) == layout
    loaded = import_dflash(tmp_path, target=target)
    sequence = torch.tensor([trained["responses"]["prompt_ids"][0] + trained["responses"]["response_ids"][0]])
    features = target_features(target, sequence, layer_ids=feature_layers(drafter))
    anchors = torch.arange(2, sequence.shape[1] - 1)[None]
    head = target.get_output_embeddings()
    with torch.no_grad():
        a = head(anchored_block_hidden(drafter, target.get_input_embeddings(), features, sequence[:, anchors[0]], anchors))
        b = head(anchored_block_hidden(loaded, target.get_input_embeddings(), features, sequence[:, anchors[0]], anchors))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="not a z-lab or speculators"):
        import_dflash(tmp_path / "missing")


@pytest.mark.slow
def test_offline_smollm2_routes_are_lossless(tmp_path):
    """The real target (SmolLM2-135M-Instruct): mask token 16 (<empty_output>), layers 1/14/26 (hidden states
    2/15/27, EAGLE-3's); our loop, exact greedy tau, stock transformers' DFlash route and the adaptive one all
    reproduce plain greedy (an untrained drafter: the mechanics, not the acceptance)."""
    from transformers import AutoTokenizer

    from ppow_trl.serving.assisted import load_assistant, save_assistant
    from ppow_trl.drafters.dflash import choose_mask_token_id
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_path

    target = load_target(smollm2_path())
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    assert choose_mask_token_id(tokenizer) == 16
    drafter = dflash_from_target(target, mask_token_id=16, num_hidden_layers=1).eval()
    assert drafter.config.target_layer_ids == [1, 14, 26] and feature_layers(drafter) == [2, 15, 27]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)  # the prompt holds <|im_end|> = the pad id: HF would mask it without this
    plain = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None)
    policy = AdaptiveWindowPolicy(3, 0.0)
    ours = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=12, eos_token_id=[])
    assert torch.equal(ours.sequences, plain[:, : ours.sequences.shape[1]])
    exact = exact_greedy_tau(target, drafter, ids, policy=policy, max_new_tokens=12, eos_token_id=[])
    assert exact.accepted_per_round == ours.accepted_per_round
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None, speculation_type="dflash")
    assert torch.equal(target.generate(ids, assistant_model=drafter, **kwargs), plain)
    save_assistant(drafter, tmp_path, policy=AdaptiveWindowPolicy(4, 0.9), tokenizer=tokenizer)
    assistant = load_assistant(tmp_path, target=target)
    assert torch.equal(target.generate(ids, assistant_model=assistant, **kwargs), plain)
    assert assistant._ppow_block_window.window_lengths  # the rule ran on every round


def test_bench_takes_block_drafters(trained, tmp_path, capsys):
    """python -m ppow_trl.bench: a DFlash drafter runs as stock transformers' fixed block (hf_assisted), with our
    adaptive window (hook) and in our loop, all lossless; HF's other schedules are skipped with a message; the cost
    model is per round."""
    import json

    from ppow_trl.bench import BenchDrafter, main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 56}" for j in range(6))})
                               + "\n" for i in range(2)))
    drafters = [BenchDrafter("dflash", trained["drafter"], AdaptiveWindowPolicy(max_window=4, threshold=0.3))]
    report = main(["--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "12", "--modes", "greedy",
                   "--methods", "target", "hf_assisted", "hf_heuristic", "hook", "fast_adaptive", "--output",
                   str(tmp_path / "b"), "--no-progress", "--cost-repeats", "1", "--warmup-tokens", "2"],
                  target=trained["target"], tokenizer=trained["tokenizer"], drafters=drafters)
    assert "hf_heuristic skipped for dflash" in capsys.readouterr().err
    assert {r["method"] for r in report["records"]} == {"target", "hf_assisted", "hook", "fast_adaptive"}
    assert all(r["lossless"] for r in report["records"])
    loop = [r for r in report["records"] if r["method"] == "fast_adaptive"]
    assert max(r["tau"] for r in loop) > 1.0
    assert all(r["drafter_forwards"] == sum(1 for w in r["window_lengths"] if w) for r in loop)
    assert report["drafters"][0]["cost_per_round"] is True


def test_bad_inputs_get_errors_that_say_what_to_do(trained):
    """A mismatched target, a window longer than the block, a mask token outside the vocabulary and a tokenizer with
    no spare special token are refused with a message naming the fix."""
    from ppow_trl.drafters.dflash import choose_mask_token_id, dflash_config_for
    from ppow_trl.drafting import drafting_session

    target, drafter = trained["target"], trained["drafter"]
    with pytest.raises(ValueError, match="num_hidden_layers: drafter expects 4, target has 2"):
        drafting_session(drafter, make_tiny_llama(num_layers=2))
    with pytest.raises(ValueError, match="pass target="):
        drafting_session(drafter)
    with pytest.raises(ValueError, match="not a row of the target's embedding"):
        dflash_config_for(target, mask_token_id=64)
    with pytest.raises(ValueError, match="decoder layer indices"):
        dflash_config_for(target, mask_token_id=6, target_layer_ids=[4])
    with pytest.raises(ValueError, match="pass mask_token_id="):
        choose_mask_token_id(trained["tokenizer"])  # word-level, no added special tokens
    from ppow_trl.drafters.dflash.assisted import attach_block_window

    with pytest.raises(ValueError, match="block_size - 1"):
        attach_block_window(drafter, target, AdaptiveWindowPolicy(BLOCK))


def test_one_token_prompt_drafts_from_the_first_round(trained):
    """Unlike a chain, a block needs no target feature to draft: with a one-token prompt the first round drafts
    from an empty context; the output is still the target's greedy text."""
    target, drafter = trained["target"], trained["drafter"]
    prompt = torch.tensor([[9]])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    out = speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(3), max_new_tokens=10,
                               eos_token_id=[])
    assert torch.equal(out.sequences[0], reference[0]) and out.drafted_per_round[0] == 3
    exact = exact_greedy_tau(target, drafter, prompt, policy=AdaptiveWindowPolicy(3), max_new_tokens=10,
                             eos_token_id=[])
    assert exact.accepted_per_round == out.accepted_per_round
