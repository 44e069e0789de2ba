"""Loading, truncating and reduced-vocabulary drafters, on tiny models (seconds) and SmolLM2 (slow)."""

from collections import Counter

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_tokenizer
from transformers import AutoModelForCausalLM

from ppow_trl.drafter import PPOWDrafterForCausalLM
from ppow_trl.models import (
    OFFLINE_TARGET,
    build_draft_vocab,
    check_compatibility,
    draft_vocab_coverage,
    load_target,
    make_drafter,
    shared_vocab_logits,
    truncate_model,
)

# Every 3rd id plus EOS (3): a draft vocabulary that misses most tokens, so masking is exercised.
DRAFT_IDS = sorted(set(range(0, 64, 3)) | {3})


def _inputs(batch=2, length=7, vocab_size=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, vocab_size, (batch, length), generator=generator)


# ----------------------------------------------------------------------------- truncate_model


def test_truncate_model_reproduces_first_layers(tiny_target):
    truncated = truncate_model(tiny_target, 2)
    input_ids = _inputs()

    assert truncated.config.num_hidden_layers == 2 and len(truncated.model.layers) == 2
    assert tiny_target.config.num_hidden_layers == 4  # the target's config is untouched
    with torch.no_grad():
        full = tiny_target(input_ids, output_hidden_states=True)
        # hidden_states[2] is the residual stream after layer 2, before the final norm
        expected = tiny_target.lm_head(tiny_target.model.norm(full.hidden_states[2]))
        torch.testing.assert_close(truncated(input_ids).logits, expected)


def test_truncate_model_copies_and_keeps_ties(tiny_target):
    truncated = truncate_model(tiny_target, 1)

    assert truncated.lm_head.weight is truncated.model.embed_tokens.weight  # tie_word_embeddings=True
    for name, param in truncated.named_parameters():
        source = tiny_target.get_parameter(name)
        assert torch.equal(param, source) and param.data_ptr() != source.data_ptr(), name
    with pytest.raises(ValueError, match="between 1 and 4"):
        truncate_model(tiny_target, 0)
    with pytest.raises(ValueError, match="between 1 and 4"):
        truncate_model(tiny_target, 5)


def test_truncate_model_keeps_chosen_layers_in_order(tiny_target):
    """layer_ids [0, 3]: the residual stream through layers 0 and 3 only, computed by hand from the target's modules."""
    truncated = truncate_model(tiny_target, layer_ids=[3, 0])  # any order: the layers run in the model's order
    input_ids = _inputs()
    assert truncated.config.num_hidden_layers == 2
    assert [layer.self_attn.layer_idx for layer in truncated.model.layers] == [0, 1]  # renumbered for the KV cache
    assert torch.equal(truncated.model.layers[1].mlp.down_proj.weight, tiny_target.model.layers[3].mlp.down_proj.weight)
    with torch.no_grad():
        model = tiny_target.model
        hidden = model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        rotary = model.rotary_emb(hidden, positions)
        mask = torch.full((input_ids.shape[1],) * 2, float("-inf")).triu(1)[None, None]
        for index in (0, 3):
            hidden = model.layers[index](hidden, attention_mask=mask, position_embeddings=rotary,
                                         position_ids=positions)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        expected = tiny_target.lm_head(model.norm(hidden))
        torch.testing.assert_close(truncated(input_ids).logits, expected)
    with pytest.raises(ValueError, match="distinct layer indices in \\[0, 3\\]"):
        truncate_model(tiny_target, layer_ids=[0, 4])
    with pytest.raises(ValueError, match="distinct"):
        truncate_model(tiny_target, layer_ids=[1, 1])
    with pytest.raises(ValueError, match="exactly one"):
        truncate_model(tiny_target, 2, layer_ids=[0, 1])
    drafter = make_drafter(tiny_target, layer_ids=[0, 3])
    assert drafter.config.num_hidden_layers == 2


def test_truncate_model_shortens_layer_types():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )
    truncated = truncate_model(Qwen3ForCausalLM(config).eval(), 2)
    assert truncated.config.layer_types == config.layer_types[:2]
    assert truncated(_inputs()).logits.shape == (2, 7, 64)


def test_truncate_model_carries_per_layer_settings_with_their_layers():
    """SmolLM3's `no_rope_layers` (1 = RoPE, 0 = none): layers [0, 3] keep their own flags, so the kept NoPE layer
    stays NoPE; a config naming layers by index refuses layer_ids."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM, SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           no_rope_layers=[1, 1, 1, 0], pad_token_id=0)
    truncated = truncate_model(SmolLM3ForCausalLM(config).eval(), layer_ids=[0, 3])
    assert truncated.config.no_rope_layers == [1, 0]
    assert [layer.self_attn.use_rope for layer in truncated.model.layers] == [1, 0]
    moe = Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=2,
                         num_experts_per_tok=1, decoder_sparse_step=2, pad_token_id=0)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        truncate_model(Qwen2MoeForCausalLM(moe).eval(), layer_ids=[0, 2])


def test_truncated_model_save_reload(tiny_target, tmp_path):
    truncated = truncate_model(tiny_target, 2)
    truncated.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    input_ids = _inputs()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, truncated(input_ids).logits)


# ----------------------------------------------------------------------------- reduced vocabulary


def test_reduced_vocab_logits_match_on_draft_ids(tiny_target):
    drafter = PPOWDrafterForCausalLM.from_causal_lm(tiny_target, DRAFT_IDS)
    input_ids = _inputs()
    outside = [i for i in range(64) if i not in DRAFT_IDS]

    with torch.no_grad():
        expected = tiny_target(input_ids).logits
        output = drafter(input_ids)
    assert output.logits.shape == expected.shape
    torch.testing.assert_close(output.logits[..., DRAFT_IDS], expected[..., DRAFT_IDS])
    torch.testing.assert_close(output.draft_logits, expected[..., DRAFT_IDS])
    probs = output.logits.softmax(-1)
    assert not probs.isnan().any()
    assert (probs[..., outside] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 7))
    assert drafter(input_ids, full_vocab_logits=False).logits is None


def test_reduced_vocab_drafter_trains_with_labels(tiny_drafter):
    drafter = PPOWDrafterForCausalLM.from_causal_lm(tiny_drafter, DRAFT_IDS).train()
    labels = torch.tensor([DRAFT_IDS[:7], DRAFT_IDS[1:8]])
    loss = drafter(_inputs(), labels=labels).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert drafter.lm_head.weight.grad.abs().sum() > 0
    assert drafter.get_input_embeddings() is drafter.model.embed_tokens
    assert drafter.get_output_embeddings().weight.shape == (len(DRAFT_IDS), 32)  # never tied


def test_reduced_vocab_drafter_save_reload(tiny_drafter, tmp_path):
    drafter = PPOWDrafterForCausalLM.from_causal_lm(tiny_drafter, DRAFT_IDS, full_vocab_size=80)
    drafter.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()

    assert isinstance(reloaded, PPOWDrafterForCausalLM)
    assert reloaded.draft_vocab_ids.tolist() == DRAFT_IDS
    assert reloaded.config.full_vocab_size == 80
    input_ids = _inputs()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, drafter(input_ids).logits)  # -inf == -inf included


def _spread_weights(model, std=0.3, seed=0):
    """Larger random weights: with the default std 0.02 a tiny model repeats one token whatever the input."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0, std)
    return model


@pytest.mark.parametrize("drafter_source", ["target", "other"])
def test_assisted_generation_with_reduced_drafter_is_lossless(tiny_target, tiny_drafter, drafter_source):
    target, other = _spread_weights(tiny_target), _spread_weights(tiny_drafter, seed=1)
    draft_ids = [i for i in range(64) if i % 5]
    # From the target itself most drafts are accepted; from another model most are rejected.
    drafter = PPOWDrafterForCausalLM.from_causal_lm(target if drafter_source == "target" else other, draft_ids)
    input_ids = _inputs(batch=1, length=5)
    kwargs = dict(do_sample=False, max_new_tokens=16, pad_token_id=0)

    greedy = target.generate(input_ids, **kwargs)
    target_calls = []
    hook = target.register_forward_hook(lambda *args: target_calls.append(1))
    assisted = target.generate(input_ids, assistant_model=drafter, **kwargs)
    hook.remove()

    assert torch.equal(assisted, greedy)
    assert any(token % 5 == 0 for token in greedy[0, 5:].tolist())  # some tokens the drafter cannot propose
    if drafter_source == "target":
        assert len(target_calls) < 16  # drafts were accepted: the drafter was really used


def test_lora_on_reduced_drafter(tiny_drafter, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    drafter = PPOWDrafterForCausalLM.from_causal_lm(tiny_drafter, DRAFT_IDS)
    model = get_peft_model(drafter, LoraConfig(task_type="CAUSAL_LM", target_modules=["q_proj", "v_proj"], r=4))
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)

    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    labels = torch.tensor([DRAFT_IDS[:7], DRAFT_IDS[1:8]])
    model(input_ids=_inputs(), labels=labels).loss.backward()
    optimizer.step()
    params = dict(model.named_parameters())
    assert any(not torch.equal(params[name], before) for name, before in trainable.items())
    assert all(torch.equal(params[name], before) for name, before in frozen.items())

    model.save_pretrained(tmp_path)
    base = PPOWDrafterForCausalLM.from_causal_lm(tiny_drafter, DRAFT_IDS)
    reloaded = PeftModel.from_pretrained(base, tmp_path).eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(_inputs()).logits, model(_inputs()).logits)


# ----------------------------------------------------------------------------- compatibility


def test_check_compatibility_rejects_other_tokenizer(tiny_target, tiny_drafter, tiny_tokenizer):
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_compatibility(tiny_target, tiny_drafter, tiny_tokenizer, make_tiny_tokenizer(extra_words=4))
    other_eos = make_tiny_tokenizer()
    other_eos.eos_token = "<eos>"
    with pytest.raises(ValueError, match="EOS"):
        check_compatibility(tiny_target, tiny_drafter, tiny_tokenizer, other_eos)
    assert check_compatibility(tiny_target, tiny_drafter, tiny_tokenizer, make_tiny_tokenizer()) == 64


def test_check_compatibility_with_padded_rows(tiny_tokenizer):
    target = make_tiny_llama(vocab_size=80)  # padded: 80 rows for 64 tokens
    drafter = make_tiny_llama(vocab_size=64, num_layers=1)
    assert check_compatibility(target, drafter, tiny_tokenizer) == 64
    reduced = PPOWDrafterForCausalLM.from_causal_lm(drafter, DRAFT_IDS, full_vocab_size=80)
    assert check_compatibility(target, reduced, tiny_tokenizer) == 64
    with pytest.raises(ValueError, match="drafter has 64 output rows"):
        check_compatibility(target, drafter, make_tiny_tokenizer(extra_words=4))

    target_logits, drafter_logits = torch.randn(2, 3, 80), reduced(_inputs()).logits
    assert shared_vocab_logits(target_logits, 64).shape == (2, 3, 64)
    assert torch.equal(shared_vocab_logits(drafter_logits, 64), drafter_logits[..., :64])


# ----------------------------------------------------------------------------- make_drafter


def test_make_drafter_truncates_with_reduced_vocab(tiny_target, tiny_tokenizer):
    tiny_target.requires_grad_(False)
    drafter = make_drafter(tiny_target, num_layers=1, draft_vocab_ids=DRAFT_IDS, target_tokenizer=tiny_tokenizer)

    assert isinstance(drafter, PPOWDrafterForCausalLM) and not drafter.training
    assert drafter.config.text_config.num_hidden_layers == 1
    assert all(p.requires_grad for p in drafter.parameters())
    with pytest.raises(ValueError, match="exactly one"):
        make_drafter(tiny_target)
    with pytest.raises(ValueError, match="exactly one"):
        make_drafter(tiny_target, num_layers=1, pretrained="x")


def test_make_drafter_pretrained_checks_tokenizer(tiny_target, tiny_drafter, tiny_tokenizer, tmp_path):
    tiny_drafter.save_pretrained(tmp_path / "same")
    tiny_tokenizer.save_pretrained(tmp_path / "same")
    drafter = make_drafter(tiny_target, pretrained=tmp_path / "same", target_tokenizer=tiny_tokenizer)
    assert drafter.config.num_hidden_layers == 1

    tiny_drafter.save_pretrained(tmp_path / "other")
    make_tiny_tokenizer(extra_words=4).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizer differs"):
        make_drafter(tiny_target, pretrained=tmp_path / "other", target_tokenizer=tiny_tokenizer)


# ----------------------------------------------------------------------------- draft vocabulary


def test_build_draft_vocab_and_coverage_match_brute_force():
    generator = torch.Generator().manual_seed(0)
    # Skewed ids so that frequencies differ: squares of uniform draws concentrate near 0.
    sequences = [
        (torch.rand(int(n), generator=generator) ** 3 * 50).long().tolist()
        for n in torch.randint(1, 30, (20,), generator=generator)
    ]
    counts = Counter(token for sequence in sequences for token in sequence)
    always = [3, 49]

    vocab = build_draft_vocab(sequences, size=10, vocab_size=50, always_include=always)

    ranked = sorted(range(50), key=lambda token: (token not in always, -counts[token], token))
    assert vocab.tolist() == sorted(ranked[:10])
    assert vocab.dtype == torch.long
    total = sum(len(sequence) for sequence in sequences)
    inside = sum(token in set(vocab.tolist()) for sequence in sequences for token in sequence)
    assert draft_vocab_coverage(vocab, sequences) == pytest.approx(inside / total)
    assert draft_vocab_coverage(range(50), sequences) == 1.0


def test_build_draft_vocab_validates():
    with pytest.raises(ValueError, match="size"):
        build_draft_vocab([[1, 2]], size=0, vocab_size=10)
    with pytest.raises(ValueError, match="always_include"):
        build_draft_vocab([[1, 2]], size=1, vocab_size=10, always_include=[1, 2])
    with pytest.raises(ValueError, match="token ids"):
        build_draft_vocab([[1, 12]], size=2, vocab_size=10)


# ----------------------------------------------------------------------------- load_target


def test_load_target_errors(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(OSError, match="no_such_model"):
        load_target(str(missing))
    with pytest.raises(ValueError, match="4bit"):
        load_target(str(missing), quantization="3bit")


@pytest.mark.slow
def test_load_target_4bit_smollm2():
    pytest.importorskip("bitsandbytes")
    target = load_target(OFFLINE_TARGET, quantization="4bit")

    assert not target.training and not any(p.requires_grad for p in target.parameters())
    assert type(target.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    with torch.no_grad():
        logits = target(torch.tensor([[1, 504, 3458, 314, 253]])).logits
    assert logits.shape == (1, 5, 49152) and torch.isfinite(logits).all()


@pytest.mark.slow
def test_make_drafter_smollm2_reduced_vocab_round_trip(tmp_path):
    from transformers import AutoTokenizer

    from ppow_trl.offline import smollm2_path

    target = load_target(OFFLINE_TARGET)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    messages = [[{"role": "user", "content": "Name three colors."}], [{"role": "user", "content": "What is 2+2?"}]]
    # transformers 5 returns a BatchEncoding from `tokenize=True` unless `return_dict=False`.
    sequences = [tokenizer.apply_chat_template(m, add_generation_prompt=True, return_dict=False) for m in messages]
    draft_ids = build_draft_vocab(sequences, 2048, vocab_size=len(tokenizer), always_include=[tokenizer.eos_token_id])

    drafter = make_drafter(target, num_layers=2, draft_vocab_ids=draft_ids, target_tokenizer=tokenizer)
    assert check_compatibility(target, drafter, tokenizer) == 49152
    assert draft_vocab_coverage(draft_ids, sequences) == 1.0
    drafter.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    input_ids = torch.tensor([sequences[0]])
    with torch.no_grad():
        logits = drafter(input_ids).logits
        assert torch.equal(reloaded(input_ids).logits, logits)
    assert logits.shape[-1] == 49152 and torch.isfinite(logits[..., draft_ids]).all()
