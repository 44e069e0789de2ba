"""The prompt-lookup drafter family: n-gram drafting from the text itself, with the project's window rule and guard.

Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) proposes the tokens that followed
the latest earlier occurrence of the sequence's last ``n`` tokens (``n = max_ngram_size .. min_ngram_size``, the
longest match first). Here it is a drafter like any other: its next-token distribution is a function of the
sequence, ``q(. | x) = softmax(z)`` with ``z_v = confidence_logit`` for the looked-up token and 0 elsewhere
(uniform when nothing matches), so the window rule (``prod conf_j >= h``, up to ``K``) stops a window where the
lookup runs out, the cost model measures what a lookup costs, the calibration may choose ``K = 0`` and the online
guard pauses drafting where lookups stop paying. Greedy and sampled verification are lossless as for every drafter.

Nothing is trained: the family is evaluated as built (``trainable = False``). The model object is a
``PreTrainedModel`` with no weights (an empty parameter anchors its device and dtype) so that HF's assisted
generation takes it as ``assistant_model`` and ``save_pretrained`` / ``from_pretrained`` keep its settings.
"""

from __future__ import annotations

import functools

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from ._family_io import read_config
from ..serving.assistant_loop import check_assistant_call, draft_window
from ..batching import shift_rows
from ..drafting import DrafterFamily
from ..serving.windowing import configure_generation_config


class PromptLookupConfig(PretrainedConfig):
    """Settings of a prompt-lookup drafter: the vocabulary of its logits, the n-gram sizes tried (longest first) and
    the logit of the looked-up token (``softmax`` gives it ``e^c / (e^c + V - 1)``: 0.9999 at ``c = 20``, ``V = 49k``)."""

    model_type = "ppow_prompt_lookup"

    def __init__(self, vocab_size: int = 32000, max_ngram_size: int = 3, min_ngram_size: int = 1,
                 confidence_logit: float = 20.0, **kwargs):
        if not 1 <= min_ngram_size <= max_ngram_size:
            raise ValueError(f"Need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}.")
        self.vocab_size, self.max_ngram_size, self.min_ngram_size = vocab_size, max_ngram_size, min_ngram_size
        self.confidence_logit = confidence_logit
        super().__init__(**kwargs)


def lookup_next_token(sequence: list[int], max_ngram_size: int, min_ngram_size: int) -> int | None:
    """The token after the latest earlier occurrence of ``sequence``'s last ``n`` tokens, for the largest ``n`` in
    ``[min_ngram_size, max_ngram_size]`` that has one; ``None`` when no suffix recurs."""
    length = len(sequence)
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        suffix = sequence[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest first; the continuation sequence[start + n] exists
            if sequence[start : start + n] == suffix:
                return sequence[start + n]
    return None


class PromptLookupDrafter(PreTrainedModel, GenerationMixin):
    """A drafter without weights whose logits are the n-gram lookup's (module docstring)."""

    config_class = PromptLookupConfig
    base_model_prefix = "prompt_lookup"
    main_input_name = "input_ids"

    def __init__(self, config: PromptLookupConfig):
        super().__init__(config)
        # The loops read a drafter's device and dtype from its parameters.
        self.anchor = torch.nn.Parameter(torch.zeros(0), requires_grad=False)
        self.post_init()

    def _init_weights(self, module):
        """Nothing to initialise."""

    def lookup_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """``(len(sequences), V)`` next-token logits of each sequence."""
        config = self.config
        logits = torch.zeros((len(sequences), config.vocab_size), device=self.anchor.device, dtype=self.anchor.dtype)
        for row, sequence in enumerate(sequences):
            token = lookup_next_token(sequence, config.max_ngram_size, config.min_ngram_size)
            if token is not None and token < config.vocab_size:
                logits[row, token] = config.confidence_logit
        return logits

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        """Logits ``(B, T, V)`` of every prefix (teacher forced), for inspection; the loops use the session."""
        rows = []
        for b, ids in enumerate(input_ids.tolist()):
            keep = ids if attention_mask is None else [t for t, m in zip(ids, attention_mask[b].tolist()) if m]
            rows.append(self.lookup_logits([keep[: i + 1] for i in range(len(keep))]))
        width = max(len(r) for r in rows)
        logits = torch.stack([torch.nn.functional.pad(r, (0, 0, width - len(r), 0)) for r in rows])
        return CausalLMOutput(logits=logits)


class PromptLookupSession:
    """The drafting state of prompt lookup: each row's sequence (committed and drafted tokens)."""

    target_layer_ids = None
    max_window = None

    def __init__(self, drafter):
        self.drafter = drafter
        self.sequences: list[list[int]] = []
        self.forwards = 0  # lookups run (one per drafted token): what the cost model charges

    def _logits(self) -> torch.Tensor:
        self.forwards += 1
        return self.drafter.lookup_logits(self.sequences)

    def prefill(self, contexts, pad_id: int = 0, num_samples: int = 1, features=None) -> torch.Tensor:
        self.sequences = [list(map(int, c)) for c in contexts for _ in range(num_samples)]
        return self._logits()

    def extend(self, sequence: list[int], features=None) -> torch.Tensor:
        self.sequences = [list(sequence)]
        return self._logits()

    def add_features(self, features) -> None:
        """Prompt lookup reads no target features."""

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        for sequence, token in zip(self.sequences, tokens.view(-1).tolist()):
            sequence.append(int(token))
        return self._logits()

    def rollback(self, valid_length: int) -> None:
        self.sequences = [sequence[:valid_length] for sequence in self.sequences]

    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int, features=None):
        """As ``StandaloneSession.teacher_forced_logits``: the lookup is a function of the sequence, so slot ``k`` of a
        window after ``prompt + text[:s]`` is the lookup after ``prompt + text[:s + k]``."""
        sequence = list(prompt) + list(text)
        logits = self.drafter.lookup_logits([sequence[: len(prompt) + s] for s in range(len(text))])
        for slot in range(max_window):
            yield slot, shift_rows(logits, slot)

    def timed_step(self, context: list[int], features=None):
        """A callable running one lookup after ``context`` (the state put back each time)."""
        self.sequences = [list(context)]

        def step():
            self.step(torch.tensor(context[-1:]))
            self.sequences = [list(context)]

        return step


@torch.no_grad()
def lookup_generate(*args, model, input_ids=None, generation_config=None, logits_processor=None, max_new_tokens=None,
                    **kwargs):
    """The drafter's ``generate`` as HF's assistant: one window of lookups after the committed ``input_ids``."""
    input_ids = input_ids if input_ids is not None else args[0]
    check_assistant_call(generation_config, input_ids, "prompt-lookup")
    session = PromptLookupSession(model)
    logits = session.extend(input_ids[0].tolist())
    return draft_window(model, session, logits, input_ids, generation_config, logits_processor, max_new_tokens)


class PromptLookupFamily(DrafterFamily):
    """Prompt lookup (module docstring)."""

    name = "prompt_lookup"
    description = "prompt lookup (n-gram drafting from the text)"
    peft_task_type = None
    trainable = False
    reduced_head = False
    writes_hook_file = False  # its HF route is its own generate, installed by load_assistant (attach)
    hf_methods = ()  # HF's own prompt lookup is the benchmark's `prompt_lookup` method; this one runs our rule

    def owns(self, model) -> bool:
        return isinstance(model, PromptLookupDrafter)

    def detect(self, folder_or_repo, **hub_kwargs) -> str | None:
        config = read_config(folder_or_repo, **hub_kwargs)
        return "transformers" if config and config.get("model_type") == PromptLookupConfig.model_type else None

    def build(self, target, tokenizer=None, *, draft_vocab_ids=None, seed=None, target_name_or_path=None,
              max_ngram_size: int = 3, min_ngram_size: int = 1, confidence_logit: float = 20.0, **options):
        """A lookup drafter over the target's vocabulary (``draft_vocab_ids``, ``seed`` and ``num_layers`` have
        nothing to act on)."""
        options.pop("num_layers", None)
        if options:
            raise ValueError(f"{sorted(options)} do not apply to prompt-lookup drafters.")
        vocab = target.get_output_embeddings().out_features if target is not None else len(tokenizer)
        config = PromptLookupConfig(vocab_size=vocab, max_ngram_size=max_ngram_size, min_ngram_size=min_ngram_size,
                                    confidence_logit=confidence_logit)
        drafter = PromptLookupDrafter(config)
        if target is not None:
            drafter.to(device=next(target.parameters()).device)
            drafter.generation_config = target.generation_config.__class__.from_dict(target.generation_config.to_dict())
        return drafter.eval()

    def load(self, folder_or_repo, *, target=None, **from_pretrained_kwargs):
        from_pretrained_kwargs.pop("trust_remote_code", None)  # our own class: no remote code involved
        drafter = PromptLookupDrafter.from_pretrained(str(folder_or_repo), **from_pretrained_kwargs)
        if target is not None and "device_map" not in from_pretrained_kwargs:
            drafter.to(device=next(target.parameters()).device)
        return drafter.eval()

    def session(self, drafter, target=None):
        return PromptLookupSession(drafter)

    def input_vocab_size(self, drafter, target) -> int:
        return drafter.config.vocab_size

    def describe(self, drafter) -> str:
        config = drafter.config
        return f"prompt lookup, n-grams {config.max_ngram_size}..{config.min_ngram_size}"

    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        configure_generation_config(drafter.generation_config, policy, vocab_size)
        drafter.generate = functools.partial(lookup_generate, model=drafter)
        return drafter
