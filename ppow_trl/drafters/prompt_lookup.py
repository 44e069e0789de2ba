"""The prompt-lookup drafter family: n-gram drafting from the text itself, with the project's window rule and guard.

Prompt lookup decoding (Saxena 2023; transformers' ``prompt_lookup_num_tokens``) proposes the tokens that followed
the latest earlier occurrence of the sequence's last ``n`` tokens (``n = max_ngram_size .. min_ngram_size``, the
longest match first). Here it is a drafter like any other: its next-token distribution is a function of the
sequence, ``q(. | x) = softmax(z)`` with ``z_v = c`` for the looked-up token and 0 elsewhere (uniform when nothing
matches), so the window rule (``prod conf_j >= h``, up to ``K``) stops a window where the
lookup runs out, the cost model measures what a lookup costs, the calibration may choose ``K = 0`` and the online
guard pauses drafting where lookups stop paying. Greedy and sampled verification are lossless as for every drafter.

What a lookup is worth depends on the length ``n`` of the n-gram it matched: on SmolLM2's greedy ShareGPT responses a
unigram match was the next token 16-20% of the time, a bigram 52-54%, a trigram 74-81%. With one logit for every
match the window rule cannot tell them apart (each looked-up token had confidence 0.9999), so on text that does not
repeat it drafted after every common token and lost. ``fit_match_confidences`` measures the hit rate ``p_n`` of each
length on held-out text (the calibration contexts; ``calibrate_for_serving`` fits it before choosing the rule), and
the looked-up token's logit is then ``c_n = log(p_n (V - 1) / (1 - p_n))``, so that its probability is ``p_n``: the
rule's threshold ``h`` on ``prod conf_j`` becomes a bound on the window's hit rate.

Nothing is trained: the family is evaluated as built (``trainable = False``). The model object is a
``PreTrainedModel`` with no weights (an empty parameter anchors its device and dtype) so that HF's assisted
generation takes it as ``assistant_model`` and ``save_pretrained`` / ``from_pretrained`` keep its settings.
"""

from __future__ import annotations

import functools
import math

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from ._family_io import read_config
from ..serving.assistant_loop import check_assistant_call, draft_window
from ..batching import shift_rows
from ..drafting import DrafterFamily
from ..core.windowing import configure_generation_config


class PromptLookupConfig(PretrainedConfig):
    """Settings of a prompt-lookup drafter: the vocabulary of its logits, the n-gram sizes tried (longest first) and
    the logit of the looked-up token (``softmax`` gives it ``e^c / (e^c + V - 1)``: 0.9999 at ``c = 20``, ``V = 49k``)."""

    model_type = "ppow_prompt_lookup"

    def __init__(self, vocab_size: int = 32000, max_ngram_size: int = 3, min_ngram_size: int = 1,
                 confidence_logit: float = 20.0, match_confidences: list[float] | None = None,
                 min_match_confidence: float = 0.0, **kwargs):
        check_lookup_settings(max_ngram_size, min_ngram_size, match_confidences, min_match_confidence)
        self.vocab_size, self.max_ngram_size, self.min_ngram_size = vocab_size, max_ngram_size, min_ngram_size
        self.confidence_logit = confidence_logit
        # p_n for n = 1..max_ngram_size (fit_match_confidences); None: every lookup at confidence_logit
        self.match_confidences = None if match_confidences is None else [float(p) for p in match_confidences]
        # a lookup whose p_n is below this counts as no match (the hybrid: its trained drafter proposes instead)
        self.min_match_confidence = float(min_match_confidence)
        super().__init__(**kwargs)


def check_lookup_settings(max_ngram_size: int, min_ngram_size: int, match_confidences, min_match_confidence) -> None:
    """A clear error for n-gram sizes or fitted confidences that cannot be served."""
    if not 1 <= min_ngram_size <= max_ngram_size:
        raise ValueError(f"Need 1 <= min_ngram_size <= max_ngram_size, got {min_ngram_size}, {max_ngram_size}.")
    if match_confidences is not None and (len(match_confidences) != max_ngram_size
                                          or not all(0.0 < float(p) < 1.0 for p in match_confidences)):
        raise ValueError(f"match_confidences holds p_n in (0, 1) for n = 1..max_ngram_size ({max_ngram_size} values), "
                         f"got {match_confidences!r}: fit them with fit_match_confidences.")
    if not 0.0 <= min_match_confidence < 1.0:
        raise ValueError(f"min_match_confidence must be in [0, 1), got {min_match_confidence}.")


def match_logit(confidence: float, vocab_size: int) -> float:
    """``c = log(p (V - 1) / (1 - p))``: the logit of the looked-up token (0 elsewhere) whose softmax probability is
    ``p`` over ``V`` tokens, ``e^c / (e^c + V - 1) = p``. ``p`` is kept above ``2 / V`` so that ``c > 0`` (a looked-up
    token always beats the rest)."""
    p = min(max(float(confidence), 2.0 / vocab_size), 1.0 - 1e-6)
    return math.log(p * (vocab_size - 1) / (1.0 - p))


def lookup_next_match(sequence: list[int], max_ngram_size: int, min_ngram_size: int) -> tuple[int, int] | None:
    """``(token, n)``: the token after the latest earlier occurrence of ``sequence``'s last ``n`` tokens, for the
    largest ``n`` in ``[min_ngram_size, max_ngram_size]`` that has one; ``None`` when no suffix recurs."""
    length = len(sequence)
    for n in range(min(max_ngram_size, length - 1), min_ngram_size - 1, -1):
        suffix = sequence[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest first; the continuation sequence[start + n] exists
            if sequence[start : start + n] == suffix:
                return sequence[start + n], n
    return None


def lookup_next_token(sequence: list[int], max_ngram_size: int, min_ngram_size: int) -> int | None:
    """The looked-up token of ``lookup_next_match`` (``None`` when no suffix recurs)."""
    match = lookup_next_match(sequence, max_ngram_size, min_ngram_size)
    return None if match is None else match[0]


def match_counts(sequences, max_ngram_size: int, min_ngram_size: int) -> tuple[list[int], list[int]]:
    """``(lookups, hits)`` per match length ``n = 1..max_ngram_size``: over every position ``t >= 1`` of every
    sequence, the lookup after ``sequence[:t]`` (``lookup_next_match``) matched an ``n``-gram, and its token was
    ``sequence[t]``. Sequences that are a prefix of another are counted once (calibration contexts are prefixes of
    one response). One pass per sequence: each n-gram's latest start is kept in a dict as the sequence grows."""
    lookups, hits = [0] * max_ngram_size, [0] * max_ngram_size
    for sequence in _longest_only([list(map(int, s)) for s in sequences]):
        latest: list[dict] = [{} for _ in range(max_ngram_size + 1)]
        for t in range(1, len(sequence)):
            for n in range(min_ngram_size, max_ngram_size + 1):
                start = t - 1 - n  # the n-gram whose continuation sequence[t - 1] just arrived
                if start >= 0:
                    latest[n][tuple(sequence[start:start + n])] = start
            for n in range(min(max_ngram_size, t - 1), min_ngram_size - 1, -1):
                start = latest[n].get(tuple(sequence[t - n:t]))
                if start is not None:
                    lookups[n - 1] += 1
                    hits[n - 1] += sequence[start + n] == sequence[t]
                    break
    return lookups, hits


def _longest_only(sequences: list[list[int]]) -> list[list[int]]:
    kept: list[list[int]] = []
    for sequence in sorted(sequences, key=len, reverse=True):
        if not any(other[:len(sequence)] == sequence for other in kept):
            kept.append(sequence)
    return kept


def fit_match_confidences(sequences, max_ngram_size: int, min_ngram_size: int) -> list[float]:
    """``p_n = (hits_n + 1) / (lookups_n + 2)`` for ``n = 1..max_ngram_size`` (``match_counts``; the add-one prior keeps
    a length never seen at 1/2 and every ``p_n`` inside (0, 1))."""
    lookups, hits = match_counts(sequences, max_ngram_size, min_ngram_size)
    return [(h + 1) / (n + 2) for n, h in zip(lookups, hits)]


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

    def proposal(self, sequence: list[int]) -> tuple[int, float] | None:
        """``(token, logit)`` the lookup proposes after ``sequence``: ``c_n`` (``match_logit`` of the fitted ``p_n``;
        ``confidence_logit`` before any fit) on the looked-up token; ``None`` where nothing matches, the token is outside
        the vocabulary, or ``p_n`` is under ``min_match_confidence``."""
        config = self.config
        match = lookup_next_match(sequence, config.max_ngram_size, config.min_ngram_size)
        if match is None or match[0] >= config.vocab_size:
            return None
        token, n = match
        confidences = getattr(config, "match_confidences", None)
        if confidences is None:
            return token, config.confidence_logit
        if confidences[n - 1] < getattr(config, "min_match_confidence", 0.0):
            return None
        return token, match_logit(confidences[n - 1], config.vocab_size)

    def proposal_logits(self, proposals: list[tuple[int, float] | None]) -> torch.Tensor:
        """``(len(proposals), V)`` logits: each proposal's logit on its token, 0 elsewhere (all zeros for ``None``)."""
        logits = torch.zeros((len(proposals), self.config.vocab_size), device=self.anchor.device,
                             dtype=self.anchor.dtype)
        for row, proposal in enumerate(proposals):
            if proposal is not None:
                logits[row, proposal[0]] = proposal[1]
        return logits

    def lookup_logits(self, sequences: list[list[int]]) -> torch.Tensor:
        """``(len(sequences), V)`` next-token logits of each sequence (``proposal``, ``proposal_logits``)."""
        return self.proposal_logits([self.proposal(sequence) for sequence in sequences])

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
        return f"prompt lookup, n-grams {config.max_ngram_size}..{config.min_ngram_size}" + describe_fit(config)

    def fit_confidences(self, drafter, contexts) -> dict:
        return fit_lookup_config(drafter.config, contexts)

    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        configure_generation_config(drafter.generation_config, policy, vocab_size)
        drafter.generate = functools.partial(lookup_generate, model=drafter)
        return drafter


def fit_lookup_config(config, contexts) -> dict:
    """Fit ``config.match_confidences`` (``fit_match_confidences``) on ``contexts``, in place (a hybrid's copies share
    its config). Returns the fitted settings, for reports."""
    confidences = fit_match_confidences(contexts, config.max_ngram_size, config.min_ngram_size)
    check_lookup_settings(config.max_ngram_size, config.min_ngram_size, confidences, config.min_match_confidence)
    config.match_confidences = confidences
    return {"match_confidences": confidences, "min_match_confidence": config.min_match_confidence}


def describe_fit(config) -> str:
    """``, hit rate per match length 1/2/3 = 0.18/0.52/0.81`` once fitted, else nothing."""
    confidences = getattr(config, "match_confidences", None)
    if confidences is None:
        return ""
    return (f", hit rate per match length {'/'.join(str(n + 1) for n in range(len(confidences)))} = "
            + "/".join(f"{p:.2f}" for p in confidences))
