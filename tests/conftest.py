"""Tiny models and a tokenizer built locally in well under a second: no test touches the network."""

from __future__ import annotations

import os

import pytest
import torch

# One thread: two were erratic on the 2-core CI machines (see BENCHMARKS.md "Thread setting").
torch.set_num_threads(int(os.environ.get("PPOW_TRL_NUM_THREADS", "1")))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_target():
    return make_tiny_llama(num_layers=4, seed=0)


@pytest.fixture
def tiny_drafter():
    return make_tiny_llama(num_layers=1, seed=1)
