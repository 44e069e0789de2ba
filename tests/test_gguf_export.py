"""GGUF export of standalone drafters (``ppow_trl.interop.gguf_export``): written in llama.cpp's layout, read back by
transformers' own GGUF loader with the same logits (fp32) and the same greedy text; the vocabulary round-trips; what
cannot be written is refused with a message. The slow test compares a SmolLM2 drafter's file with the llama.cpp-made
GGUF the offline target ships in, tensor by tensor."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from conftest import make_tiny_llama, make_tiny_tokenizer
from transformers import AutoTokenizer

from ppow_trl.drafter import PPOWDrafterForCausalLM
from ppow_trl.drafting import detect_family, get_family, load_drafter
from ppow_trl.interop.gguf_export import (
    NO_VOCAB,
    expanded_head_agreement,
    export_gguf,
    llama_permute,
    load_gguf_drafter,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them",
    "a small drafter proposes a window of tokens",
    "numbers like 12 and 345 and words like drafting, verifying, accepting",
]
PROMPTS = ["the quick brown", "<|im_start|>user a drafter<|im_end|>", "speculative decoding 12"]


def make_bpe_tokenizer(vocab_size: int = 320, corpus=CORPUS):
    """A byte-level BPE fast tokenizer (GPT-2 style, like SmolLM2's) trained in memory on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS, show_progress=False)
    backend.train_from_iterator(list(corpus) * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")


@pytest.fixture(scope="module")
def tokenizer():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    return make_tiny_llama(vocab_size=len(tokenizer), num_layers=4, seed=0, initializer_range=0.5)


def _ids(tokenizer, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt").input_ids


def _greedy_text(model, tokenizer, text: str, new_tokens: int = 16) -> str:
    ids = _ids(tokenizer, text)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:])


def assert_same_drafter(original, loaded, tokenizer, prompts=PROMPTS, atol=1e-5):
    """Logits within fp32 tolerance on every prompt, and the same greedy text."""
    for text in prompts:
        ids = _ids(tokenizer, text)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, original(ids).logits, atol=atol, rtol=1e-5)
        assert _greedy_text(loaded, tokenizer, text) == _greedy_text(original, tokenizer, text)


def _fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items()}


def _tensor_types(path) -> dict:
    return {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(path).tensors}


# -- weights -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_f32_export_reloads_with_the_same_logits_and_greedy_text(tokenizer, tmp_path, tied):
    drafter = make_tiny_llama(vocab_size=len(tokenizer), num_layers=2, seed=1, initializer_range=0.5,
                              tie_word_embeddings=tied)
    path = export_gguf(drafter, tmp_path / "drafter.gguf", tokenizer)
    assert path == tmp_path / "drafter.gguf"
    names = set(_tensor_types(path))
    assert {"token_embd.weight", "blk.0.attn_q.weight", "blk.1.ffn_down.weight", "output_norm.weight"} <= names
    assert ("output.weight" in names) == (not tied)  # tied embeddings: no output tensor, as llama.cpp writes them
    loaded = load_gguf_drafter(path).eval()
    assert loaded.config.tie_word_embeddings == tied
    assert loaded.config.num_hidden_layers == 2 and loaded.dtype == torch.float32
    assert_same_drafter(drafter, loaded, tokenizer)
    fields = _fields(path)
    assert fields["general.architecture"] == "llama" and fields["general.file_type"] == 0  # ALL_F32
    assert fields["llama.attention.head_count_kv"] == 2 and fields["llama.rope.dimension_count"] == 8


def test_f16_export_keeps_norms_in_f32_and_stays_close(tokenizer, tmp_path):
    drafter = make_tiny_llama(vocab_size=len(tokenizer), num_layers=2, seed=1, initializer_range=0.5)
    path = export_gguf(drafter, tmp_path, tokenizer, dtype="f16")
    assert path.name == "drafter-f16.gguf"
    types = _tensor_types(path)
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert _fields(path)["general.file_type"] == 1  # MOSTLY_F16
    loaded = load_gguf_drafter(path).eval()
    ids = _ids(tokenizer, PROMPTS[0])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, drafter(ids).logits, atol=0.1, rtol=0.05)
    with pytest.raises(ValueError, match="dtype"):
        export_gguf(drafter, tmp_path, tokenizer, dtype="q8_0")


def test_permutation_is_what_transformers_gguf_loader_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    weight = torch.randn(4 * 6, 5)  # 4 heads of dimension 6
    undo = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    permuted = llama_permute(weight, 4, 4)
    assert not torch.equal(permuted, weight)
    back = undo.process(permuted.numpy(), "blk.0.attn_q.weight").weights
    assert np.array_equal(back, weight.numpy())
    kv = torch.randn(2 * 6, 5)  # a K projection with 2 KV heads
    back = undo.process(llama_permute(kv, 4, 2).numpy(), "blk.0.attn_k.weight").weights
    assert np.array_equal(back, kv.numpy())


# -- the standalone family's export layout ----------------------------------------------------------------------


def test_family_export_of_a_truncated_target_round_trips(target, tokenizer, tmp_path):
    family = get_family("standalone")
    assert "gguf" in family.export_formats
    drafter = family.build(target, tokenizer, num_layers=2)
    family.export(drafter, tmp_path / "gguf", format="gguf", target=target, tokenizer=tokenizer)
    assert [p.name for p in (tmp_path / "gguf").iterdir()] == ["drafter-f32.gguf"]
    assert detect_family(tmp_path / "gguf") == (family, "gguf")
    loaded = load_drafter(tmp_path / "gguf", target=target).eval()
    assert any(p.requires_grad for p in loaded.parameters())  # loaded to be trained further, as after build
    assert getattr(loaded, "hf_quantizer", None) is None
    assert_same_drafter(drafter, loaded, tokenizer)


def test_family_export_finds_the_targets_saved_tokenizer(target, tokenizer, tmp_path):
    """What the recipe does: ``family.export(drafter, folder, format="gguf", target=target)`` with a target loaded
    from a folder that holds its tokenizer."""
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    saved_target = load_drafter(tmp_path / "target")
    family = get_family("standalone")
    drafter = family.build(saved_target, tokenizer, num_layers=1)
    family.export(drafter, tmp_path / "gguf", format="gguf", target=saved_target)
    fields = _fields(tmp_path / "gguf" / "drafter-f32.gguf")
    assert fields["tokenizer.ggml.model"] == "gpt2" and len(fields["tokenizer.ggml.tokens"]) == len(tokenizer)


def test_without_a_tokenizer_the_file_has_no_vocabulary_and_says_so(target, tmp_path, caplog):
    family = get_family("standalone")
    drafter = family.build(target, None, num_layers=1)
    with caplog.at_level(logging.WARNING, logger="ppow_trl.interop.gguf_export"):
        family.export(drafter, tmp_path / "gguf", format="gguf", target=target)
    assert "llama.cpp will not pair it" in caplog.text
    assert _fields(tmp_path / "gguf" / "drafter-f32.gguf")["tokenizer.ggml.model"] == NO_VOCAB
    loaded = load_drafter(tmp_path / "gguf", target=target).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, drafter(ids).logits, atol=1e-5, rtol=1e-5)


# -- vocabulary --------------------------------------------------------------------------------------------------


def test_vocabulary_round_trips_through_transformers_gguf_tokenizer(tokenizer, tmp_path):
    drafter = make_tiny_llama(vocab_size=len(tokenizer) + 4, num_layers=1, seed=2)  # 4 padding rows
    path = export_gguf(drafter, tmp_path / "d.gguf", tokenizer)
    fields = _fields(path)
    assert fields["tokenizer.ggml.model"] == "gpt2"
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    assert len(tokens) == len(tokenizer) + 4 and tokens[-1] == f"[PAD{len(tokenizer) + 3}]"
    assert types[-1] == gguf.TokenType.UNUSED
    assert [types[tokenizer.convert_tokens_to_ids(t)] for t in SPECIALS] == [gguf.TokenType.CONTROL] * 3
    assert fields["tokenizer.ggml.bos_token_id"] == tokenizer.bos_token_id
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id
    assert fields["tokenizer.ggml.add_bos_token"] is False  # the tokenizer adds no BOS: llama.cpp compares this
    assert len(fields["tokenizer.ggml.merges"]) > 0
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in [*PROMPTS, *CORPUS]:
        assert back(text).input_ids == tokenizer(text).input_ids, text


def test_vocabulary_copied_from_the_targets_gguf(tokenizer, tmp_path):
    drafter = make_tiny_llama(vocab_size=len(tokenizer), num_layers=1, seed=2)
    reference = export_gguf(drafter, tmp_path / "target.gguf", tokenizer)
    copied = export_gguf(drafter, tmp_path / "drafter.gguf", str(reference))
    ours, theirs = _fields(copied), _fields(reference)
    assert {k: v for k, v in ours.items() if k.startswith("tokenizer.")} == {
        k: v for k, v in theirs.items() if k.startswith("tokenizer.")}
    smaller = make_tiny_llama(vocab_size=len(tokenizer) - 1, num_layers=1, seed=2)
    with pytest.raises(ValueError, match="llama.cpp needs them equal"):
        export_gguf(smaller, tmp_path / "bad.gguf", str(reference))


# -- what cannot be written ----------------------------------------------------------------------------------------


def test_refusals_say_what_to_do(tokenizer, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    drafter = make_tiny_llama(vocab_size=len(tokenizer), num_layers=1, seed=3)
    peft_model = get_peft_model(make_tiny_llama(vocab_size=len(tokenizer), num_layers=1),
                                LoraConfig(target_modules=["q_proj"], r=2))
    with pytest.raises(ValueError, match="merge_and_unload"):
        export_gguf(peft_model, tmp_path, tokenizer)
    with pytest.raises(ValueError, match="byte-level BPE"):
        export_gguf(make_tiny_llama(num_layers=1), tmp_path, make_tiny_tokenizer())  # word-level tokenizer
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match="Llama-architecture"):
        export_gguf(qwen, tmp_path, tokenizer)
    scaled = make_tiny_llama(vocab_size=len(tokenizer), num_layers=1,
                             rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="rotary scaling"):
        export_gguf(scaled, tmp_path, tokenizer)
    with pytest.raises(ValueError, match="not a .gguf file"):
        export_gguf(drafter, tmp_path / "x.gguf", str(tmp_path / "missing.gguf"))
    assert not list(tmp_path.glob("*.gguf"))


def test_reduced_head_is_refused_unless_expanded_and_expansion_is_exact_on_the_draft_vocabulary(tokenizer, tmp_path):
    base = make_tiny_llama(vocab_size=len(tokenizer), num_layers=1, seed=4, initializer_range=0.5)
    draft_ids = torch.arange(0, len(tokenizer), 3)
    drafter = PPOWDrafterForCausalLM.from_causal_lm(base, draft_ids).eval()
    with pytest.raises(ValueError, match="expand_reduced_head=True"):
        export_gguf(drafter, tmp_path, tokenizer)
    path = export_gguf(drafter, tmp_path, tokenizer, expand_reduced_head=True)
    assert "output.weight" in _tensor_types(path)
    loaded = load_gguf_drafter(path).eval()
    ids = torch.cat([_ids(tokenizer, text) for text in PROMPTS[:1]])
    with torch.no_grad():
        ours, theirs = loaded(ids).logits, drafter(ids, full_vocab_logits=False).draft_logits
    torch.testing.assert_close(ours[..., draft_ids], theirs, atol=1e-5, rtol=1e-5)
    outside = torch.ones(len(tokenizer), dtype=torch.bool)
    outside[draft_ids] = False
    assert torch.equal(ours[..., outside], torch.zeros_like(ours[..., outside]))
    # Greedy proposals agree exactly where the best draft logit is above 0 (what expanded_head_agreement counts).
    keeps = theirs.max(-1).values > 0
    same = draft_ids[theirs.argmax(-1)] == ours.argmax(-1)
    assert torch.equal(same[keeps], torch.ones_like(same[keeps]))
    assert expanded_head_agreement(drafter, ids) == pytest.approx(float(keeps.float().mean()))


# -- the offline SmolLM2 target ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_two_layer_drafter_matches_llama_cpp_layout_and_greedy_text(tmp_path):
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_gguf_path, smollm2_path

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = load_target(path)
    drafter = get_family("standalone").build(target, tokenizer, num_layers=2).eval()
    exported = export_gguf(drafter, tmp_path, tokenizer)
    # The target's GGUF was written by llama.cpp's converter: our layers 0-1 are its layers 0-1, dequantized.
    reference = gguf.GGUFReader(smollm2_gguf_path())
    theirs = {tensor.name: tensor for tensor in reference.tensors}
    ours = gguf.GGUFReader(exported)
    for tensor in ours.tensors:
        expected = gguf.dequantize(theirs[tensor.name].data, theirs[tensor.name].tensor_type)
        assert np.array_equal(np.asarray(tensor.data), expected.reshape(tensor.data.shape)), tensor.name
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.add_bos_token", "llama.rope.freq_base", "llama.attention.head_count_kv"):
        assert ours.fields[key].contents() == reference.fields[key].contents(), key
    loaded = load_gguf_drafter(exported).eval()
    for text in ["The capital of France is", "def fibonacci(n):"]:
        ids = _ids(tokenizer, text)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, drafter(ids).logits, atol=1e-4, rtol=1e-5)
        assert _greedy_text(loaded, tokenizer, text, 12) == _greedy_text(drafter, tokenizer, text, 12)
