"""Our GGUF drafters in llama.cpp itself (through llama-cpp-python), the real consumer of ``export_gguf``'s files:
llama.cpp reads them with our logits and greedy text, tokenizes with the vocabulary we wrote as the target's
tokenizer does, accepts them as draft models of their target by its own compatibility test, and speculative
decoding through ``LlamaCppDrafter`` gives the target's greedy text with the rounds (window lengths, accepted
lengths, guard decisions) of our own loop. Skipped without llama-cpp-python (``make llama-cpp``)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from test_gguf_export import PROMPTS, make_bpe_tokenizer

from ppow_trl.serving.generation import speculative_generate
from ppow_trl.interop.gguf_export import export_gguf
from ppow_trl.interop.llama_cpp_draft import (
    LLAMA_CPP_INSTALL,
    LlamaCppDrafter,
    common_prefix_length,
    load_llama,
    mean_accepted_length,
    pairing_problems,
    quantize_gguf,
    require_llama_cpp,
)
from ppow_trl.interop.llama_cpp_build import (
    amx_fault_expected,
    amx_fault_message,
    build_features,
    cmake_args,
    cpu_flags,
    has_amx,
    quantized_eval_probe,
)
from ppow_trl.models import truncate_model
from ppow_trl.core.windowing import AdaptiveWindowPolicy

llama_cpp = pytest.importorskip("llama_cpp", reason=f"llama-cpp-python is not installed: {LLAMA_CPP_INSTALL}")


@pytest.fixture(scope="module")
def tokenizer():
    return make_bpe_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    """A 4-layer target and its 2-layer truncation as drafter (they agree often enough for real windows)."""
    target = make_tiny_llama(vocab_size=len(tokenizer), num_layers=4, seed=0, initializer_range=0.5).eval()
    return target, truncate_model(target, 2).eval()


@pytest.fixture(scope="module")
def files(models, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    target, drafter = models
    return export_gguf(target, folder / "target.gguf", tokenizer), export_gguf(drafter, folder / "drafter.gguf", tokenizer)


def _f32(path, **kwargs):
    """llama.cpp with an f32 KV cache: an f32 model then computes our logits to fp32 rounding."""
    return load_llama(path, kv_cache_type="f32", **kwargs)


def _ids(tokenizer, text):
    return tokenizer(text).input_ids


def _teacher_forced_logits(llama, ids) -> np.ndarray:
    llama.reset()
    llama.eval(ids)
    return np.array(llama.scores[: len(ids)])


def _llama_greedy(llama, ids, new_tokens: int) -> list[int]:
    """``new_tokens`` greedy tokens from llama-cpp-python's own generation loop (speculative when the Llama has a
    draft model)."""
    out = []
    for token in llama.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(int(token))
        if len(out) == new_tokens:
            return out
    return out


def _hf_greedy(model, ids, new_tokens: int) -> list[int]:
    """Greedy tokens from transformers, not stopped at EOS (llama-cpp-python's ``generate`` does not stop there)."""
    sequence = list(ids)
    with torch.no_grad():
        for _ in range(new_tokens):
            sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(ids):]


def test_missing_bindings_name_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError, match="pip install llama-cpp-python==0.3.36"):
        require_llama_cpp()


@pytest.mark.parametrize("tied", [True, False])
def test_llama_cpp_reads_the_export_with_our_logits_and_greedy_text(tokenizer, tmp_path, tied):
    drafter = make_tiny_llama(vocab_size=len(tokenizer), num_layers=2, seed=1, initializer_range=0.5,
                              tie_word_embeddings=tied).eval()
    llama = _f32(export_gguf(drafter, tmp_path / "d.gguf", tokenizer), logits_all=True)
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        with torch.no_grad():
            ours = drafter(torch.tensor([ids])).logits[0].numpy()
        np.testing.assert_allclose(_teacher_forced_logits(llama, ids), ours, atol=1e-4, rtol=1e-4)
        assert _llama_greedy(llama, ids, 12) == _hf_greedy(drafter, ids, 12)
    llama.close()


def test_llama_cpp_tokenizes_with_the_vocabulary_we_wrote_as_the_tokenizer_does(files, tokenizer):
    llama = load_llama(files[1])
    for text in PROMPTS + ["numbers like 12, words like drafting; the lazy dog <|im_end|>"]:
        assert llama.tokenize(text.encode(), add_bos=False, special=True) == _ids(tokenizer, text), text
    llama.close()


def test_pairing_check_accepts_the_targets_vocabulary_and_refuses_others(models, files, tokenizer, tmp_path):
    target_file, drafter_file = files
    target = load_llama(target_file)
    assert pairing_problems(target, load_llama(drafter_file)) == []
    no_vocab = export_gguf(models[1], tmp_path / "no_vocab.gguf", None)
    assert "vocabulary type" in pairing_problems(target, load_llama(no_vocab))[0]
    other = make_bpe_tokenizer(corpus=["another corpus entirely, with other merges", "zebras quietly vexing jumpy"])
    small = make_tiny_llama(vocab_size=len(other), num_layers=1, seed=3)
    problems = pairing_problems(target, load_llama(export_gguf(small, tmp_path / "other.gguf", other)))
    assert problems and re.match(r"token \d+ is ", problems[0])
    with pytest.raises(ValueError, match="llama.cpp would refuse .*vocabulary type"):
        LlamaCppDrafter(no_vocab, target=target)
    target.close()


@pytest.mark.parametrize("policy", [AdaptiveWindowPolicy(max_window=3), AdaptiveWindowPolicy(max_window=4, threshold=0.6)],
                         ids=["fixed K=3", "adaptive K=4 h=0.6"])
def test_speculative_decoding_in_llama_cpp_is_the_targets_text_with_our_rounds(models, files, tokenizer, policy):
    target, drafter = models
    target_file, drafter_file = files
    plain = _f32(target_file)
    draft = LlamaCppDrafter(drafter_file, policy, target=plain, kv_cache_type="f32")
    speculative = _f32(target_file, draft_model=draft)
    new_tokens = 24
    for text in PROMPTS:
        ids = _ids(tokenizer, text)
        draft.reset_stats()
        tokens = _llama_greedy(speculative, ids, new_tokens)
        assert tokens == _llama_greedy(plain, ids, new_tokens) == _hf_greedy(target, ids, new_tokens)
        # llama-cpp-python samples the first token from the prompt's forward and drafts from the second on: its
        # rounds are those of our loop started after the prompt and that token (run longer, so that no window of
        # ours is cut by the token budget). It stops consuming mid-round at new_tokens: the rounds it scored are
        # ours, in order.
        ours = speculative_generate(target, drafter, torch.tensor([ids + tokens[:1]]), policy=policy,
                                    max_new_tokens=new_tokens + 8, eos_token_id=[])
        assert ours.new_tokens[: new_tokens - 1] == tokens[1:]
        # All but the last round are scored; that one commits at most K + 1 tokens.
        assert sum(accepted + 1 for _, accepted in draft.rounds) >= new_tokens - 2 - policy.max_window
        assert draft.rounds == list(zip(ours.drafted_per_round, ours.accepted_per_round))[: len(draft.rounds)]
    assert mean_accepted_length(draft.rounds) > 1.0  # the truncation agrees with its target often
    plain.close()


def test_the_online_guard_pauses_drafting_in_llama_cpp_as_in_our_loop(models, files, tokenizer):
    target, drafter = models
    # A break-even above any reachable A + 1: each round loses at least 2 steps, so the guard pauses within 4 drafting
    # rounds, and again after each resumption (for 3 rounds, then 6, ...).
    policy = AdaptiveWindowPolicy(max_window=2, guard={"break_even_tokens": 5.0, "loss_budget": 6.0, "probe_every": 3})
    draft = LlamaCppDrafter(files[1], policy, kv_cache_type="f32")
    speculative = _f32(files[0], draft_model=draft)
    ids = _ids(tokenizer, PROMPTS[0])
    draft.reset_stats()
    tokens = _llama_greedy(speculative, ids, 30)
    ours = speculative_generate(target, drafter, torch.tensor([ids + tokens[:1]]), policy=policy, max_new_tokens=40,
                                eos_token_id=[])  # llama-cpp-python drafts from the second token on
    assert tokens[1:] == ours.new_tokens[:29]
    decisions = draft.guard.decisions
    assert False in decisions and len(decisions) >= 12 and decisions == ours.guard_decisions[: len(decisions)]


def test_quantized_drafter_stays_close_and_still_pairs(models, files, tokenizer, tmp_path):
    q8 = quantize_gguf(files[1], tmp_path / "drafter-q8_0.gguf", "q8_0")
    assert q8.stat().st_size < 0.5 * files[1].stat().st_size
    crash = quantized_eval_probe(q8)  # in a child process: a faulty build fails this test, not the worker
    assert crash is None, crash
    ids = _ids(tokenizer, PROMPTS[1])
    with torch.no_grad():
        ours = models[1](torch.tensor([ids])).logits[0].numpy()
    quantized = _teacher_forced_logits(load_llama(q8, logits_all=True), ids)
    # A random tiny model with large weights (initializer_range 0.5) amplifies 8-bit rounding: measured 7% of the
    # mean |logit| and 7 of 8 argmaxes; an unrelated model would be ~100%.
    assert np.abs(quantized - ours).mean() < 0.15 * np.abs(ours).mean()
    assert (quantized.argmax(-1) == ours.argmax(-1)).mean() >= 0.75
    assert pairing_problems(load_llama(files[0]), load_llama(q8)) == []
    with pytest.raises(ValueError, match="file_type"):
        quantize_gguf(files[1], tmp_path / "x.gguf", "q2_k")


def test_quantized_models_evaluate_with_this_build_on_this_cpu():
    """The shipped SmolLM2 Q4_1 file, evaluated by llama.cpp in a child process. On a CPU with AMX, llama.cpp's
    native build crashed here (ppow_trl.interop.llama_cpp_build); `make llama-cpp` builds without its AMX backend there."""
    from ppow_trl.offline import smollm2_gguf_path

    flags = cpu_flags()
    assert not amx_fault_expected(flags), amx_fault_message(flags)
    crash = quantized_eval_probe(smollm2_gguf_path())
    assert crash is None, f"(CPU with AMX: {has_amx(flags)}; build: {build_features()}) {crash}"


def test_amx_cpus_get_a_build_without_the_amx_backend():
    sapphire_rapids = {"sse4_2", "avx", "f16c", "fma", "bmi2", "avx2", "avx_vnni", "avx512f", "avx512cd", "avx512vl",
                       "avx512dq", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                       "amx_bf16"}
    args = cmake_args(sapphire_rapids)
    assert "-DGGML_NATIVE=OFF" in args and {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(args)
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AVX2=ON",
            "-DGGML_AVX_VNNI=ON"} <= set(args)
    assert cmake_args(sapphire_rapids - {"amx_tile", "amx_int8", "amx_bf16"}) == []  # native everywhere else
    no_avx512 = cmake_args({"avx", "avx2", "fma", "amx_tile"})
    assert "-DGGML_AVX512=OFF" in no_avx512 and "-DGGML_AVX512_BF16=OFF" in no_avx512
    assert amx_fault_expected(sapphire_rapids, {"AVX512": "1", "AMX_INT8": "1"})
    assert not amx_fault_expected(sapphire_rapids, {"AVX512": "1"})  # built without AMX
    assert not amx_fault_expected({"avx2"}, {"AMX_INT8": "1"})  # the CPU has no AMX: the backend stays unused


def test_a_faulty_build_refuses_quantized_files_instead_of_crashing(files, tmp_path, monkeypatch):
    import ppow_trl.interop.llama_cpp_draft as draft_module

    q8 = quantize_gguf(files[1], tmp_path / "drafter-q8_0.gguf", "q8_0")
    monkeypatch.setattr(draft_module, "amx_fault_expected", lambda: True)
    with pytest.raises(RuntimeError, match="make llama-cpp"):
        load_llama(q8)
    assert not draft_module.is_quantized(load_llama(files[1]))  # F32 and F16 files still load


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0 and common_prefix_length([7], [8]) == 0


# -- the offline SmolLM2 -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_drafter_in_llama_cpp_next_to_the_shipped_q4_1_target(tmp_path):
    from transformers import AutoTokenizer

    from ppow_trl.drafting import get_family
    from ppow_trl.models import load_target
    from ppow_trl.offline import smollm2_gguf_path, smollm2_path

    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    target = load_target(path).eval()
    drafter = get_family("standalone").build(target, tokenizer, num_layers=2).eval()
    # Written from the Hugging Face tokenizer (not copied from the target's GGUF): llama.cpp must read our BPE
    # vocabulary as the tokenizer, and accept it next to the llama.cpp-converted target.
    drafter_file = export_gguf(drafter, tmp_path / "drafter.gguf", tokenizer)
    shipped = load_llama(smollm2_gguf_path())
    assert pairing_problems(shipped, load_llama(drafter_file)) == []
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False),
             "def fibonacci(n):\n\treturn n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)  # 🦙 Ünïcode '' 3.14"]
    drafter_llama = _f32(drafter_file, logits_all=True)
    for text in texts:
        ids = tokenizer(text).input_ids
        assert drafter_llama.tokenize(text.encode(), add_bos=False, special=True) == ids
        with torch.no_grad():
            ours = drafter(torch.tensor([ids])).logits[0].numpy()
        theirs = _teacher_forced_logits(drafter_llama, ids)
        assert np.abs(theirs - ours).max() < 1e-3 * np.abs(ours).max()
        assert _llama_greedy(drafter_llama, ids, 12) == _hf_greedy(drafter, ids, 12)
    # The fp32 target exported the same way decodes in llama.cpp as in transformers, and speculative decoding with
    # the drafter gives its text (the shipped Q4_1 target is not batch-invariant in llama.cpp: see docs/benchmarks.md).
    target_file = export_gguf(target, tmp_path / "target.gguf", smollm2_gguf_path())
    plain = _f32(target_file)
    speculative = _f32(target_file, draft_model=LlamaCppDrafter(drafter_file, max_window=3, target=plain,
                                                                kv_cache_type="f32"))
    ids = tokenizer(texts[0]).input_ids
    tokens = _llama_greedy(plain, ids, 8)
    assert tokenizer.decode(tokens).startswith("The capital of France is Paris")
    assert _llama_greedy(speculative, ids, 8) == tokens == _hf_greedy(target, ids, 8)


def test_the_window_rule_saved_next_to_the_file_is_the_one_used(files, tmp_path):
    import shutil

    folder = tmp_path / "export"
    folder.mkdir()
    gguf_file = Path(shutil.copy(files[1], folder / "drafter-f32.gguf"))
    assert LlamaCppDrafter(gguf_file).policy == AdaptiveWindowPolicy(max_window=4)  # nothing saved: a fixed K = 4
    saved = AdaptiveWindowPolicy(max_window=3, threshold=0.4, confidence_temperature=0.7)
    saved.save_pretrained(folder)
    assert LlamaCppDrafter(gguf_file).policy == saved
    overridden = LlamaCppDrafter(gguf_file, max_window=1).policy
    assert (overridden.max_window, overridden.threshold, overridden.confidence_temperature) == (1, 0.4, 0.7)
    with pytest.raises(FileNotFoundError, match="export_gguf"):
        LlamaCppDrafter(folder / "missing.gguf")


def test_a_new_prompt_starts_a_new_generation_for_the_guard_and_the_rounds(models, files, tokenizer):
    """llama-cpp-python calls the draft model with no notice of a new request: a call whose ids do not extend the
    last call's starts afresh (the guard's history and the unscored window do not carry over)."""
    target, drafter = models
    policy = AdaptiveWindowPolicy(max_window=2, guard={"break_even_tokens": 5.0, "loss_budget": 6.0, "probe_every": 3})
    draft = LlamaCppDrafter(files[1], policy, kv_cache_type="f32")
    speculative = _f32(files[0], draft_model=draft)
    for text in PROMPTS[:2]:  # no reset_stats() between the two requests
        ids = _ids(tokenizer, text)
        before = len(draft.rounds)
        tokens = _llama_greedy(speculative, ids, 20)
        ours = speculative_generate(target, drafter, torch.tensor([ids + tokens[:1]]), policy=policy,
                                    max_new_tokens=30, eos_token_id=[])
        decisions = draft.guard.decisions
        assert decisions == ours.guard_decisions[: len(decisions)] and len(decisions) >= 8
        scored = draft.rounds[before:]
        drafting_rounds = [(L, A) for L, A in zip(ours.drafted_per_round, ours.accepted_per_round) if L > 0]
        assert scored == drafting_rounds[: len(scored)]


def test_windows_stay_inside_the_drafters_context(files, tokenizer):
    target = _f32(files[0], n_ctx=256)
    draft = LlamaCppDrafter(files[1], max_window=4, target=target, kv_cache_type="f32")
    n_ctx = draft.llama.n_ctx()
    assert n_ctx == target.n_ctx() == 256  # the target's context by default
    ids = [5 + i % 300 for i in range(n_ctx - 7)]  # room for 7 more tokens
    assert len(draft(np.array(ids, dtype=np.intc))) == 4
    assert len(draft(np.array(ids + [7, 8, 9, 10], dtype=np.intc))) == 3  # 3 fit
    assert len(draft(np.array(ids + [7] * 7, dtype=np.intc))) == 0  # full
