"""A drafter with a reduced output vocabulary that still looks like an ordinary causal LM.

EAGLE-3 showed that a drafter only needs to predict the few thousand tokens a target actually
writes: the output head is the largest part of a small drafter (28M of SmolLM2's 135M parameters),
and a head over `draft_vocab_size` rows instead of the full vocabulary makes each drafted token
cheaper. Verification, HF's assisted generation and our rewards, however, compare drafter and target
distributions over the *target's* vocabulary. So `PPOWDrafterForCausalLM` computes the small logits
and scatters them into a full-width tensor:

    logits[..., draft_vocab_ids] = draft_logits,   logits[..., other ids] = -inf

Why `-inf` and not `torch.finfo(dtype).min`: softmax gives exactly 0 probability outside the draft
vocabulary in every dtype, `-inf` survives dtype casts (fp32's most negative value becomes `-inf`
in fp16 anyway), and it is the value HF's logits processors use for banned tokens, whose arithmetic
(temperature < 1, repetition penalty) would turn `finfo.min` into `-inf` anyway. No NaN appears in
softmax because every row holds at least one finite logit (the draft vocabulary is never empty).
Formulas with `p * log q` must use `torch.xlogy` or the draft logits: `0 * -inf` is NaN, and a
target that puts mass outside the draft vocabulary gives an infinite KL(p||q), which is correct:
such tokens can never be accepted. Training code should use `output.draft_logits` (small, finite)
and gather the target's logits at `draft_vocab_ids`.

Saved drafters reload with `AutoModelForCausalLM.from_pretrained(folder)` after `import ppow_trl`
(this module registers the config and model classes with the Auto classes on import).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.configuration_utils import PreTrainedConfig, SubConfigSpec
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils.deprecation import deprecate_kwarg


@strict
class PPOWDrafterConfig(PreTrainedConfig):
    r"""
    Configuration of [`PPOWDrafterForCausalLM`]: a decoder backbone plus a reduced-vocabulary head.

    Args:
        text_config (`dict` or `PreTrainedConfig`, *optional*):
            Config of the decoder stack (for example a `LlamaConfig`), built with `AutoModel.from_config`.
            A dict must hold its `model_type`. It is called `text_config` (not `backbone_config`) because
            `generate` builds its KV cache from `config.get_text_config(decoder=True)`, which looks for this
            name, and because transformers reserves `backbone_config` for vision backbones.
        draft_vocab_size (`int`, *optional*, defaults to `32000`):
            Rows of the drafter's output head: how many target token ids the drafter can propose.
        full_vocab_size (`int`, *optional*):
            Width of the logits `forward` returns: the target's number of output rows, so that drafter and
            target logits line up. Defaults to `text_config.vocab_size`. HF's assisted generation compares
            `config.get_text_config().vocab_size` (here the backbone's embedding rows) with the target's and
            asks for two tokenizers when they differ, as it would for the source model.
        tie_word_embeddings (`bool`, *optional*, defaults to `False`):
            Always `False`: the reduced head has other rows than the input embeddings and is never tied.
    """

    model_type = "ppow_drafter"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    draft_vocab_size: int = 32000
    full_vocab_size: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.full_vocab_size is None:
            self.full_vocab_size = self.text_config.vocab_size
        # A tied flag left over from the source model would make PEFT (which reads `tie_word_embeddings`)
        # treat the reduced head as tied to the input embeddings.
        self.text_config.tie_word_embeddings = False

    def validate_architecture(self):
        """Part of `@strict` validation: the head cannot propose more ids than the logits hold."""
        super().validate_architecture()
        if not 1 <= self.draft_vocab_size <= self.full_vocab_size:
            raise ValueError(
                f"draft_vocab_size ({self.draft_vocab_size}) must be between 1 and full_vocab_size "
                f"({self.full_vocab_size})."
            )


@dataclass
class PPOWDrafterOutputWithPast(CausalLMOutputWithPast):
    r"""
    [`CausalLMOutputWithPast`] plus the drafter's small logits.

    Args:
        draft_logits (`torch.FloatTensor` of shape `(batch_size, sequence_length, draft_vocab_size)`):
            Scores over the draft vocabulary only; column `j` is token `draft_vocab_ids[j]`. Cheaper than the
            full-width `logits` for training losses.
    """

    draft_logits: torch.FloatTensor | None = None


class ReducedVocabHeadMixin:
    """Target-id bookkeeping of a head over ``draft_vocab_ids`` (a sorted buffer of target ids); shared by
    ``PPOWDrafterForCausalLM`` and the EAGLE-3 drafter. Needs ``self.draft_vocab_ids`` and
    ``self.config.full_vocab_size``."""

    def draft_index(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the draft head for target token ids; -100 (ignored label) for ids outside the draft vocabulary.

        TRL's fused LM head scores labels against `get_output_embeddings()` (our reduced head), so labels
        in target ids must be mapped to draft rows first (see PPOWTrainer). -100 stays -100.
        """
        ids = self.draft_vocab_ids
        rows = torch.searchsorted(ids, token_ids.clamp_min(0)).clamp(max=len(ids) - 1)
        inside = (ids[rows] == token_ids) & (token_ids >= 0)
        return torch.where(inside, rows, torch.full_like(rows, -100))

    def to_full_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter `(..., draft_vocab_size)` scores into `(..., full_vocab_size)`, `-inf` elsewhere (module doc)."""
        shape = (*draft_logits.shape[:-1], self.config.full_vocab_size)
        logits = draft_logits.new_full(shape, float("-inf"))
        return logits.index_copy(-1, self.draft_vocab_ids, draft_logits)


class PPOWDrafterForCausalLM(ReducedVocabHeadMixin, PreTrainedModel, GenerationMixin):
    """A causal LM whose head covers `draft_vocab_ids` only and whose logits cover the full vocabulary."""

    config: PPOWDrafterConfig
    # Explicit: transformers 5 would derive it from the annotation above, which `from __future__ import
    # annotations` turns into a string.
    config_class = PPOWDrafterConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # The attention itself lives in the backbone; these flags let `from_pretrained(attn_implementation=...)`
    # accept the implementations every modern HF decoder supports. `_no_split_modules` and the like are
    # collected from the backbone by `post_init`.
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # No `_tied_weights_keys`: the reduced head must never be tied to the input embeddings.

    def __init__(self, config: PPOWDrafterConfig):
        super().__init__(config)
        self.model = AutoModel.from_config(config.text_config)
        self.lm_head = nn.Linear(config.text_config.hidden_size, config.draft_vocab_size, bias=False)
        # Persistent, so it is saved and reloaded with the weights. The placeholder is overwritten by
        # `from_causal_lm` or by the checkpoint.
        self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        self.post_init()

    @classmethod
    def from_causal_lm(
        cls, causal_lm: PreTrainedModel, draft_vocab_ids, full_vocab_size: int | None = None
    ) -> PPOWDrafterForCausalLM:
        """Build a reduced-vocabulary drafter from an ordinary causal LM (e.g. `LlamaForCausalLM`).

        The decoder stack is copied; the head keeps the original head's rows for `draft_vocab_ids`, so the
        new drafter's logits equal the old ones on those ids. `full_vocab_size` (the target's output rows)
        defaults to the causal LM's own number of output rows.
        """
        ids = _as_sorted_unique_ids(draft_vocab_ids)
        head = causal_lm.get_output_embeddings()
        head_rows = head.weight.shape[0]
        full_vocab_size = full_vocab_size if full_vocab_size is not None else head_rows
        if ids[-1] >= min(head_rows, full_vocab_size):
            raise ValueError(
                f"draft_vocab_ids go up to {int(ids[-1])} but the model's head has {head_rows} rows and the "
                f"logits {full_vocab_size} columns."
            )
        config = PPOWDrafterConfig(
            text_config=causal_lm.config.get_text_config().to_dict(),
            draft_vocab_size=len(ids),
            full_vocab_size=full_vocab_size,
        )
        drafter = cls(config).to(dtype=causal_lm.dtype, device=causal_lm.device)
        with torch.no_grad():
            drafter.model.load_state_dict(causal_lm.get_decoder().state_dict())
            drafter.lm_head.weight.copy_(head.weight[ids.to(head.weight.device)])
            drafter.draft_vocab_ids.copy_(ids)
        drafter.generation_config = copy.deepcopy(causal_lm.generation_config)
        return drafter.eval()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value: nn.Module):
        self.model.set_input_embeddings(value)

    def get_output_embeddings(self) -> nn.Module:
        """The reduced head (`draft_vocab_size` rows, not the full vocabulary)."""
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module):
        self.lm_head = new_embeddings

    def get_decoder(self) -> nn.Module:
        return self.model

    def resize_token_embeddings(self, *args, **kwargs):
        """Refused: resizing would treat the reduced head as if it covered the whole vocabulary."""
        raise NotImplementedError(
            "PPOWDrafterForCausalLM has a reduced-vocabulary head; resize the source model before "
            "`PPOWDrafterForCausalLM.from_causal_lm` instead."
        )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache=None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        full_vocab_logits: bool = True,
        return_dict: bool | None = None,
        **kwargs,
    ) -> PPOWDrafterOutputWithPast | tuple:
        r"""
        Same inputs as `LlamaForCausalLM.forward` (transformers 5.x calls the KV cache `cache`;
        `past_key_values=` still works until 5.40).

        full_vocab_logits (`bool`, *optional*, defaults to `True`):
            Whether to build the full-width `logits`. Training code that only needs `draft_logits` can pass
            `False` to skip the `(batch, seq, full_vocab_size)` tensor; `logits` is then `None`.
        labels (`torch.LongTensor`, *optional*):
            Next-token labels in target ids; the loss is cross-entropy on the full-width logits, so a label
            outside the draft vocabulary gives an infinite loss (it can never be predicted).
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        draft_logits = self.lm_head(hidden_states)
        logits = self.to_full_vocab(draft_logits) if full_vocab_logits or labels is not None else None

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.full_vocab_size, **kwargs)

        output = PPOWDrafterOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            draft_logits=draft_logits,
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        return output if return_dict else output.to_tuple()


def _as_sorted_unique_ids(draft_vocab_ids) -> torch.LongTensor:
    """Validate draft vocabulary ids: 1-D, non-empty, non-negative, unique; returned sorted ascending."""
    ids = torch.as_tensor(draft_vocab_ids, dtype=torch.long).cpu()
    if ids.ndim != 1 or ids.numel() == 0:
        raise ValueError(f"draft_vocab_ids must be a non-empty 1-D list of token ids, got shape {tuple(ids.shape)}.")
    if ids.min() < 0:
        raise ValueError("draft_vocab_ids must be non-negative token ids.")
    sorted_ids = torch.unique(ids)  # sorted ascending
    if sorted_ids.numel() != ids.numel():
        raise ValueError("draft_vocab_ids contains duplicates.")
    return sorted_ids


# Registered on import, so `AutoModelForCausalLM.from_pretrained(saved_drafter)` works after `import ppow_trl`.
# `exist_ok` because re-importing this module (e.g. importlib.reload in a notebook) registers again.
AutoConfig.register(PPOWDrafterConfig.model_type, PPOWDrafterConfig, exist_ok=True)
AutoModelForCausalLM.register(PPOWDrafterConfig, PPOWDrafterForCausalLM, exist_ok=True)
