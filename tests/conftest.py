"""Tiny models and a tokenizer built locally in well under a second: no test touches the network."""

from __future__ import annotations

import os

import pytest
import torch

# One thread: two were erratic on the 2-core CI machines (see docs/benchmarks.md "Thread setting").
torch.set_num_threads(int(os.environ.get("PPOW_TRL_NUM_THREADS", "1")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Packages built one at a time in the test process: the suite already runs two test processes on two cores
# (test_compiled.py's second-process test builds with two workers, explicitly).
os.environ.setdefault("PPOW_TRL_BUILD_WORKERS", "1")

TINY_WORDS = [f"w{i}" for i in range(56)]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def make_tiny_tokenizer(extra_words: int = 0):
    """A word-level fast tokenizer with a ChatML-like template and 64 (+extra) tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "<eos>"]
    vocab = {tok: i for i, tok in enumerate(specials + TINY_WORDS + [f"x{i}" for i in range(extra_words)])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_llama(vocab_size: int = 64, num_layers: int = 2, hidden_size: int = 32, seed: int = 0, **kw):
    """A randomly initialised Llama causal LM small enough to run thousands of forwards in a test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=kw.pop("tie_word_embeddings", True),
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
        **kw,
    )
    model = LlamaForCausalLM(config).eval()
    return model


def make_target_and_drafters(seed: int = 0, noise: float = 0.02):
    """A non-degenerate target, a random drafter (often wrong) and a noisy copy of the target (often right)."""
    import copy

    target = make_tiny_llama(num_layers=2, seed=seed, initializer_range=0.5)
    random_drafter = make_tiny_llama(num_layers=1, seed=seed + 1, initializer_range=0.5)
    close_drafter = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter in close_drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * noise)
    return target, random_drafter, close_drafter


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_target():
    return make_tiny_llama(num_layers=4, seed=0)


@pytest.fixture
def tiny_drafter():
    return make_tiny_llama(num_layers=1, seed=1)


def make_bigram_llama(logit_table: torch.Tensor, num_layers: int = 1):
    """A Llama whose next-token logits are exactly ``logit_table[current token]`` (a bigram model).

    Attention and MLP outputs are zeroed, so the residual stream is the token's embedding; embeddings
    are scaled one-hot vectors (RMSNorm turns them into ``sqrt(H) e_x``), and the untied head holds
    the table. Tests use it as a target whose easy and hard positions are known exactly.
    """
    vocab = logit_table.shape[0]
    model = make_tiny_llama(vocab_size=vocab, num_layers=num_layers, hidden_size=vocab, tie_word_embeddings=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        model.lm_head.weight.copy_(logit_table.T / vocab**0.5)
    return model


def easy_hard_bigram_table(vocab: int = 64, first_content: int = 8, split: int = 36, seed: int = 0) -> torch.Tensor:
    """Bigram logits: "easy" tokens [first_content, split) continue almost surely to the next token;
    "hard" tokens [split, vocab) continue uniformly to 8 tokens (half easy, half hard)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.full((vocab, vocab), -10.0)
    for token in range(vocab):
        if first_content <= token < split - 1:
            table[token, token + 1] = 10.0
        else:  # hard tokens, the last easy token and special tokens branch out
            easy = torch.randint(first_content, split, (4,), generator=g)
            hard = torch.randint(split, vocab, (4,), generator=g)
            table[token, torch.cat([easy, hard])] = 5.0
    return table


# Device-parametrised tests (tests/test_cuda.py): `cpu` always; `cuda` carries the `cuda` mark and is
# skipped without a CUDA device, so `pytest -m cuda` runs exactly the GPU half on a GPU machine.
DEVICE_PARAMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]


@pytest.fixture(params=DEVICE_PARAMS)
def device(request) -> torch.device:
    return torch.device(request.param)


def first_two_tokens_test(target, drafter, prompt, vocab: int, samples: int, max_window: int = 3, seed: int = 5):
    """Chi-square test that speculative sampling keeps the target's law: the first two sampled tokens against the
    target's own ``p(x1) p(x2 | x1)`` (a bigram target: ``x2`` depends on ``x1`` only). Returns ``(p_value, drafted
    tokens, rejected rounds)`` so callers can check the drafter was exercised."""
    from scipy.stats import chisquare

    from ppow_trl.serving.generation import speculative_generate
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    with torch.no_grad():
        step = torch.softmax(target(torch.arange(vocab)[None]).logits[0], -1)
        first = torch.softmax(target(prompt).logits[0, -1], -1)
    expected = (first[:, None] * step).flatten().double()
    counts = torch.zeros(vocab * vocab, dtype=torch.double)
    generator = torch.Generator().manual_seed(seed)
    drafted = rejections = 0
    for _ in range(samples):
        out = speculative_generate(target, drafter, prompt, policy=AdaptiveWindowPolicy(max_window, 0.0),
                                   max_new_tokens=3, do_sample=True, eos_token_id=[], generator=generator)
        counts[out.new_tokens[0] * vocab + out.new_tokens[1]] += 1
        drafted += sum(out.drafted_per_round)
        rejections += sum(a < d for a, d in zip(out.accepted_per_round, out.drafted_per_round))
    _, p_value = chisquare(counts.numpy(), (expected / expected.sum() * samples).numpy())
    return p_value, drafted, rejections


def tiny_word_responses(target, tokenizer, count: int = 16):
    """The target's greedy responses (12 tokens) to ``count`` short word prompts: the data the family tests train
    and evaluate on."""
    from datasets import Dataset

    from ppow_trl.data import build_target_responses

    words = [" ".join(f"w{1 + (i * 7 + j) % 55}" for j in range(2 + i % 5)) for i in range(count)]
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": text}]} for i, text in enumerate(words)]
    return build_target_responses(target, tokenizer, Dataset.from_list(rows), max_new_tokens=12, batch_size=8,
                                  do_sample=False)
