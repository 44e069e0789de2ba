"""The standalone drafter family: any causal LM over the target's vocabulary drafting on its own.

A truncated target (``ppow_trl.models.make_drafter(target, num_layers=...)``), a small LM of the same tokenizer, or
a ``PPOWDrafterForCausalLM`` (reduced-vocabulary head). Its drafting state is its own KV cache; HF's assisted
generation calls it as a causal LM, with ppow_trl's window rule installed as its ``generate``
(``attach_window_policy``, defined with the window rule in ``ppow_trl.core.windowing``; the folder's copy is
``custom_generate/generate.py``).
"""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ._family_io import read_config
from ..batching import left_pad, positions_from_mask, prefill_contexts, shift_rows
from ..drafter import ReducedVocabHeadMixin
from ..drafting import HUB_KWARGS, DrafterFamily
from ..features import forward_at, target_forward
from ..interop.gguf_export import export_gguf, gguf_files, load_gguf_drafter
from ..models import make_drafter
from ..utils import PEFT_ASSISTANT_MESSAGE, crop_cache, unwrap_model
from ..core.windowing import attach_window_policy, configure_generation_config


class StandaloneSession:
    """A causal LM drafting on its own: its state is its KV cache over the tokens it has read."""

    target_layer_ids = None
    max_window = None  # no limit on the window

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None
        self.mask = self.positions = None
        self.forwards = 0  # drafter forwards run (one per drafted token)

    # one sequence ---------------------------------------------------------------------------------------
    def seen(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def extend(self, sequence: list[int], features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the committed tokens not cached yet (at least the last one); logits of the next token ``(1, V)``."""
        start = self.seen()
        out, _ = forward_at(self.drafter, sequence[start:], self.cache, start, logits_to_keep=1)
        self.forwards += 1
        self.cache = out.cache
        self.mask = torch.ones((1, len(sequence)), dtype=torch.long, device=out.logits.device)
        self.positions = torch.full((1, 1), len(sequence) - 1, device=out.logits.device)
        return out.logits[:, -1]

    def add_features(self, features: torch.Tensor | None) -> None:
        """Target features are not read by standalone drafters."""

    def rollback(self, valid_length: int) -> None:
        """Keep the cache of the first ``valid_length`` tokens of committed + drafted (the verified prefix)."""
        if self.cache is not None:
            crop_cache(self.cache, min(self.cache.get_seq_length(), valid_length))

    # batches --------------------------------------------------------------------------------------------
    def prefill(self, contexts: list[torch.Tensor], pad_id: int = 0, num_samples: int = 1,
                features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Next-token logits ``(len(contexts) * G, V)`` after each context, rows context by context."""
        logits, self.cache, self.mask, self.positions = prefill_contexts(self.drafter, contexts, pad_id, num_samples)
        self.forwards += 1
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one drafted token per row ``(B,)``; logits of the next ``(B, V)``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        self.positions = self.positions + 1
        out = self.drafter(input_ids=tokens.view(-1, 1), attention_mask=self.mask, position_ids=self.positions,
                           cache=self.cache, use_cache=True)
        self.forwards += 1
        self.cache = out.cache
        return out.logits[:, -1]

    # teacher-forced windows ------------------------------------------------------------------------------
    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int,
                              features: torch.Tensor | None = None):
        """Yields ``(slot, logits (M, V))``: slot ``k`` (0-based) of a window started after ``prompt + text[:s]``
        is row ``s``. A standalone drafter's state while its proposals match is ``prompt + text[:s + k]``, so slot
        ``k`` of start ``s`` is the one teacher-forced pass's row ``s + k`` (rows past the text are never read)."""
        out, _ = forward_at(self.drafter, prompt + text[:-1], None, 0, logits_to_keep=len(text))
        logits = out.logits[0, -len(text):]
        for slot in range(max_window):
            yield slot, shift_rows(logits, slot)

    # the cost model's unit -------------------------------------------------------------------------------
    def timed_step(self, context: list[int], features: torch.Tensor | None = None):
        """A callable drafting one token after ``context`` (one forward on the cache), the cache put back each time."""
        device = next(self.drafter.parameters()).device
        self.prefill([torch.tensor(context, device=device)])
        length, mask, positions = self.cache.get_seq_length(), self.mask, self.positions
        token = torch.tensor(context[-1:], device=device)

        def step():
            self.step(token)
            crop_cache(self.cache, length)  # back to the shared context: every repeat times the same step
            self.mask, self.positions = mask, positions

        return step


class StandaloneFamily(DrafterFamily):
    """Causal LMs over the target's vocabulary (module docstring). The registry's fallback: asked last."""

    name = "standalone"
    description = "standalone causal LM"
    compiles = True
    export_formats = ("gguf",)  # llama.cpp's layout (ppow_trl.interop.gguf_export), for CPU users of llama-speculative

    def owns(self, model) -> bool:
        return callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is not None

    def detect(self, folder_or_repo, **hub_kwargs) -> str | None:
        """``"transformers"`` (a ``config.json`` with a model type), ``"gguf"`` (no config, ``.gguf`` files: what
        ``export(format="gguf")`` writes), else ``None``."""
        config = read_config(folder_or_repo, **hub_kwargs)
        if config is not None:
            return "transformers" if config.get("model_type") else None
        return "gguf" if gguf_files(folder_or_repo, **hub_kwargs) else None

    def build(self, target, tokenizer=None, *, draft_vocab_ids=None, seed: int | None = 0,
              target_name_or_path: str | None = None, num_layers: int | None = 2, layer_ids=None,
              pretrained: str | None = None, **options):
        """The target's first ``num_layers`` layers, its layers ``layer_ids`` (e.g. ``[0, 29]``), or the causal LM
        ``pretrained`` (``make_drafter``), with a reduced head over ``draft_vocab_ids`` when given. Deterministic:
        nothing is drawn at random."""
        if options:
            raise ValueError(f"{sorted(options)} do not apply to standalone drafters.")
        if pretrained and layer_ids:
            raise ValueError("`layer_ids` truncates the target; a `pretrained` drafter is used as it is.")
        if layer_ids and num_layers not in (None, 2, len(layer_ids)):  # 2: the default, left as it is
            raise ValueError(f"num_layers = {num_layers} and layer_ids = {list(layer_ids)} disagree: give the layers "
                             "by layer_ids alone (drafter_layer_ids in the recipe).")
        truncation = {} if pretrained else ({"layer_ids": layer_ids} if layer_ids else {"num_layers": num_layers})
        return make_drafter(target, pretrained=pretrained, draft_vocab_ids=draft_vocab_ids, target_tokenizer=tokenizer,
                            **truncation)

    def load(self, folder_or_repo, *, target=None, trust_remote_code: bool = False, **from_pretrained_kwargs):
        """``AutoModelForCausalLM.from_pretrained`` (``import ppow_trl`` registers ``PPOWDrafterForCausalLM``),
        trainable (``from_pretrained`` leaves parameters requiring grad; ``load_target`` freezes a target). A folder
        or repo holding a ``.gguf`` file and no config loads through transformers' GGUF loader (``gguf_file=``
        chooses among several)."""
        hub_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in HUB_KWARGS}
        if from_pretrained_kwargs.get("gguf_file") or self.detect(folder_or_repo, **hub_kwargs) == "gguf":
            return load_gguf_drafter(folder_or_repo, **from_pretrained_kwargs)
        model = AutoModelForCausalLM.from_pretrained(str(folder_or_repo), trust_remote_code=bool(trust_remote_code),
                                                     **from_pretrained_kwargs)
        if getattr(model, "_hf_peft_config_loaded", False):
            raise ValueError(f"{folder_or_repo} holds a PEFT adapter. " + PEFT_ASSISTANT_MESSAGE)
        return model

    def export(self, drafter, folder, *, format: str, target=None, tokenizer=None, dtype: str = "f32"):
        """``format="gguf"``: ``export_gguf`` into ``folder`` (``drafter-f32.gguf``). The vocabulary comes from
        ``tokenizer`` (a Hugging Face tokenizer or the target's GGUF file), else from the tokenizer saved with
        ``target`` (its ``name_or_path``) or with the drafter; without any, the file carries none (a warning: llama.cpp
        then cannot pair it with the target)."""
        self.check_export_format(format)
        if tokenizer is None:
            tokenizer = _saved_tokenizer(target, unwrap_model(drafter))
        return export_gguf(drafter, folder, tokenizer, dtype=dtype)

    def session(self, drafter, target=None):
        return StandaloneSession(drafter)

    def describe(self, drafter) -> str:
        model = unwrap_model(drafter)
        head = f", {model.config.draft_vocab_size}-token head" if isinstance(model, ReducedVocabHeadMixin) else ""
        return f"{type(model).__name__}, {model.config.get_text_config().num_hidden_layers} layers{head}"

    # training -------------------------------------------------------------------------------------------
    def window_hidden(self, drafter, contexts, inverse, window_ids, *, target=None, features=None):
        """Each distinct context once (with gradients), its KV cache repeated for the windows sharing it, then one
        forward over the windows: the backbone's states at ``[last context token, y_1 .. y_{C-1}]``."""
        backbone = drafter.base_model
        ids, mask = left_pad(contexts, 0)
        device = window_ids.device
        ids, mask = ids.to(device), mask.to(device)
        width = ids.shape[1]
        cache = DynamicCache(config=drafter.config.get_text_config())
        out = backbone(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), cache=cache,
                       use_cache=True)
        if cache.get_seq_length() != width:
            raise RuntimeError(
                "The drafter's forward did not fill the KV cache (activation checkpointing drops it in training): the "
                "windows would be scored without their context. Disable activation checkpointing on the drafter."
            )
        hidden = [out.last_hidden_state[:, -1:][inverse]]  # predicts y_1
        num_window_tokens = window_ids.shape[1]
        if num_window_tokens > 1:
            cache.batch_select_indices(inverse)  # differentiable indexing: each row reads its context's keys/values
            rows_mask = mask[inverse]
            full_mask = torch.cat([rows_mask, rows_mask.new_ones(rows_mask.shape[0], num_window_tokens - 1)], dim=-1)
            positions = rows_mask.sum(-1, keepdim=True) + torch.arange(num_window_tokens - 1, device=device)
            out = backbone(input_ids=window_ids[:, :-1], attention_mask=full_mask, position_ids=positions, cache=cache,
                           use_cache=True)
            hidden.append(out.last_hidden_state)  # predicts y_2..y_C
        return torch.cat(hidden, dim=1)

    def kd_rows(self, model, inputs, mask, args, target=None):
        """Student logits at the positions predicting response tokens: ``[(logits (N, C), positions)]``."""
        # Only the positions that predict some response token go through the output head.
        positions = mask.any(dim=0).nonzero().flatten()
        first, last = (int(positions[0]), int(positions[-1]) + 1) if positions.numel() else (0, 1)
        reduced = isinstance(unwrap_model(model), ReducedVocabHeadMixin)
        forward_kwargs = {
            "input_ids": inputs["input_ids"],
            "attention_mask": causal_only(inputs["attention_mask"]),
            "logits_to_keep": torch.arange(first, last, device=mask.device),
            "use_cache": False,
        }
        if reduced:
            forward_kwargs["full_vocab_logits"] = False  # finite draft logits, no -inf columns
        outputs = model(**forward_kwargs)
        logits = outputs.draft_logits if reduced else outputs.logits
        window = torch.zeros_like(mask)
        window[:, first:last] = mask[:, first:last]
        return [(logits[mask[:, first:last]], window)], outputs

    def response_distributions(self, model, ids, mask, positions, keep, *, target=None, features=None,
                               feature_layers=None):
        out, found = target_forward(model, feature_layers, input_ids=ids, attention_mask=mask, position_ids=positions,
                                    logits_to_keep=keep, use_cache=False)
        return out.logits[:, -keep:-1], found  # the very last column predicts past the sequence's end

    # serving --------------------------------------------------------------------------------------------
    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        """``attach_window_policy``; a hook the folder's own ``custom_generate/`` installed (``trust_remote_code``)
        is kept, only its generation config is set."""
        if isinstance(drafter.__dict__.get("generate"), functools.partial):
            configure_generation_config(drafter.generation_config, policy, vocab_size)
            return drafter
        return attach_window_policy(drafter, policy, vocab_size)


def causal_only(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """``None`` for a right-padded batch (every row's ones before its zeros, the KD collator's), else the mask.

    With right padding, causal attention alone keeps every real token from the pads (they all come after it), and
    without a mask SDPA runs its fused causal kernels, forward and backward; the pads' own outputs are never read."""
    if bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()):
        return None
    return attention_mask


def _saved_tokenizer(*models):
    """The tokenizer saved where the first of ``models`` that has one was loaded from (``name_or_path``), or None."""
    from transformers import AutoTokenizer

    for model in models:
        source = str(getattr(model, "name_or_path", "") or "")
        if not source:
            continue
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError):
            continue
    return None
