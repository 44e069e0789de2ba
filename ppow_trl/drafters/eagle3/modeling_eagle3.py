"""An EAGLE-3-style drafter: the target's hidden states from a few layers, fused with the next token's embedding,
through one Llama-shaped decoder layer, a norm and a (reduced-vocabulary) head.

The architecture is SpecForge's ``LlamaForCausalLMEagle3`` (what vLLM ``method: eagle3`` and SGLang load), so a
checkpoint converts to and from that layout by renaming keys (``ppow_trl.drafters.eagle3.convert``). Pair ``j`` of a
sequence ``s_0 s_1 ...`` is ``(h_j, s_{j+1})``: the target's features at ``s_j`` (they predict ``s_{j+1}``) and the
embedding of ``s_{j+1}``; its output predicts ``s_{j+2}``. Layer 0 (SpecForge's ``midlayer``)::

    x = fc(cat(h_j^{l_1}, ..., h_j^{l_n}))                       # target features -> hidden size
    a = attention(cat(input_layernorm(embed(s_{j+1})), hidden_norm(x)))   # q/k/v read 2 * hidden_size
    x = x + a;  x = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))

At drafting step 2 and later there is no target feature for the drafted token: the drafter feeds its own output
``x`` (before ``norm``) in place of ``fc(h)``, as EAGLE-3 does at inference, at position ``j + 1``.

Two ways to run it, which compute the same numbers (tested):

- ``forward``: a KV cache (``ChainCache``), for generation and rollouts; pass ``target_hidden_states`` (real
  pairs) or ``hidden_states`` (own outputs fed back), never both.
- ``unroll``: EAGLE-3's training-time test over a whole teacher-forced sequence: step ``k`` runs every pair at
  once with token ``s_{j+k+1}`` and the step ``k-1`` output at ``j``, at position ``j + k``; a query at ``j`` sees
  the real pairs ``<= j`` and its own chain ``1..k`` (the attention pattern drafting from ``j`` sees). Its step-k
  logits are exactly what greedy drafting after ``s_{..j+1}`` proposes at window slot ``k + 1`` while the first
  ``k`` proposals matched, which is what training (KD with TTT) and exact greedy tau need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import ModelOutput
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from ...drafter import ReducedVocabHeadMixin, _as_sorted_unique_ids
from .configuration_eagle3 import Eagle3DrafterConfig, default_target_layer_ids, resolve_target_layer_ids


class ChainCache:
    """Keys and values of every drafter layer, ``(B, kv_heads, T, head_dim)`` plain tensors (so gradients flow
    through a cache built in training). Same calls as transformers' caches where the loops use them."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            keys, values = torch.cat([self.keys[layer], keys], dim=2), torch.cat([self.values[layer], values], dim=2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def crop(self, max_length: int) -> None:
        """transformers' convention: a negative ``max_length`` removes that many positions."""
        length = self.get_seq_length() + max_length if max_length < 0 else max_length
        self.keys = [None if k is None else k[:, :, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :, :length] for v in self.values]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.keys = [None if k is None else k.repeat_interleave(repeats, dim=0) for k in self.keys]
        self.values = [None if v is None else v.repeat_interleave(repeats, dim=0) for v in self.values]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.keys = [None if k is None else k[indices] for k in self.keys]
        self.values = [None if v is None else v[indices] for v in self.values]


@dataclass
class Eagle3DrafterOutput(ModelOutput):
    r"""
    logits: full-width scores (``-inf`` outside the draft vocabulary), ``None`` with ``full_vocab_logits=False``.
    draft_logits: scores over the draft vocabulary (column ``c`` is token ``draft_vocab_ids[c]``).
    hidden_states: the last layer's output before ``norm``, ``(B, T, hidden_size)``: what the next drafting step
        feeds back (``forward(hidden_states=...)``).
    cache: the ``ChainCache`` (with ``use_cache``).
    unrolled_logits: with ``forward(unroll_steps=n)``, the draft logits of training-time-test steps ``0..n-1``.
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    draft_logits: torch.FloatTensor | None = None
    hidden_states: torch.FloatTensor | None = None
    cache: ChainCache | None = None
    unrolled_logits: tuple[torch.FloatTensor, ...] | None = None


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read ``input_size`` features (``2 * hidden_size`` in the fused layer)."""

    def __init__(self, config: Eagle3DrafterConfig, input_size: int):
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, x, position_embeddings, attend) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out = attend(q, k, v, self.num_heads // self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Eagle3FusedLayer(nn.Module):
    """SpecForge's ``midlayer``: attention over ``cat(input_layernorm(embeds), hidden_norm(hidden))``."""

    def __init__(self, config: Eagle3DrafterConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(config, 2 * config.hidden_size)
        self.mlp = LlamaMLP(config)
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embeds, hidden, position_embeddings, attend):
        residual = hidden
        fused = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = residual + self.self_attn(fused, position_embeddings, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3DecoderLayer(nn.Module):
    """A plain pre-norm Llama layer, for drafters with more than one layer (layers 1.. after the fused one)."""

    def __init__(self, config: Eagle3DrafterConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(config, config.hidden_size)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, embeds, hidden, position_embeddings, attend):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), position_embeddings, attend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (query head ``i`` reads kv head ``i // groups``)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def cached_attention(cache: ChainCache | None, layer: int, mask: torch.Tensor):
    """Attention over ``cache`` + the new positions under the boolean ``mask`` ``(B, 1, T_new, T_all)``."""

    def attend(q, k, v, groups):
        if cache is not None:
            k, v = cache.update(layer, k, v)
        return F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask)

    return attend


def unroll_attention(chain: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor):
    """Training-time-test attention at step ``k = len(chain)``: query ``j`` sees step-0 keys under ``mask``
    (causal and padding, ``(B, 1, T, T)``) and the keys of steps ``1..k`` at its own index ``j`` only.

    ``chain`` holds this layer's ``(keys, values)`` of steps ``0..k-1``; this step's are appended.
    """

    def attend(q, k, v, groups):
        chain.append((k, v))
        keys0, values0 = (_repeat_kv(t, groups) for t in chain[0])
        scale = q.shape[-1] ** -0.5
        scores = [(q @ keys0.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))]
        own = [tuple(_repeat_kv(t, groups) for t in kv) for kv in chain[1:]]
        scores += [(q * keys).sum(-1, keepdim=True) * scale for keys, _ in own]
        weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        width = keys0.shape[2]
        out = weights[..., :width] @ values0
        for index, (_, values) in enumerate(own):
            out = out + weights[..., width + index : width + index + 1] * values
        return out

    return attend


class Eagle3DrafterForCausalLM(ReducedVocabHeadMixin, PreTrainedModel, GenerationMixin):
    """EAGLE-3 drafter (module docstring). Build one for a target with ``from_target``."""

    config: Eagle3DrafterConfig
    config_class = Eagle3DrafterConfig
    base_model_prefix = "eagle3"
    _no_split_modules = ["Eagle3FusedLayer", "Eagle3DecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: Eagle3DrafterConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.fc = nn.Linear(config.feature_size, config.hidden_size, bias=False)
        layers = [Eagle3FusedLayer(config)] + [Eagle3DecoderLayer(config) for _ in range(config.num_hidden_layers - 1)]
        self.layers = nn.ModuleList(layers)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("draft_vocab_ids", torch.arange(config.draft_vocab_size), persistent=True)
        self.post_init()
        # The target's embedding, shared and frozen (as in EAGLE-3); re-applied after every load.
        self.embed_tokens.weight.requires_grad_(False)

    # ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_target(
        cls,
        target: PreTrainedModel,
        *,
        draft_vocab_ids=None,
        target_layer_ids: list[int] | None = None,
        num_hidden_layers: int = 1,
        target_name_or_path: str | None = None,
        seed: int | None = 0,
    ) -> Eagle3DrafterForCausalLM:
        """A fresh drafter shaped like one layer of ``target`` (heads, MLP width, RoPE), reading its layers.

        The embedding is the target's (frozen); the head starts from the target's head rows for
        ``draft_vocab_ids`` (all rows when ``None``) and ``norm`` from the target's final norm; ``fc`` and the
        decoder layer(s) are initialised at random (``seed``).
        """
        text = target.config.get_text_config()
        target_layers = text.num_hidden_layers
        layer_ids = resolve_target_layer_ids(target_layers, target_layer_ids)
        head = target.get_output_embeddings().weight
        ids = torch.arange(head.shape[0]) if draft_vocab_ids is None else _as_sorted_unique_ids(draft_vocab_ids)
        if int(ids[-1]) >= head.shape[0]:
            raise ValueError(f"draft_vocab_ids go up to {int(ids[-1])}; the target's head has {head.shape[0]} rows.")
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "hidden_act", "max_position_embeddings", "rope_parameters", "attention_bias",
                "mlp_bias", "pad_token_id", "bos_token_id", "eos_token_id")
        fields = {key: getattr(text, key) for key in keys if getattr(text, key, None) is not None}
        fields.setdefault("head_dim", text.hidden_size // text.num_attention_heads)
        config = Eagle3DrafterConfig(
            **fields,
            vocab_size=target.get_input_embeddings().weight.shape[0],
            num_hidden_layers=num_hidden_layers,
            draft_vocab_size=len(ids),
            full_vocab_size=head.shape[0],
            target_hidden_size=text.hidden_size,
            target_layer_ids=layer_ids,
            target_num_hidden_layers=target_layers,
            target_model_type=text.model_type,
            target_name_or_path=target_name_or_path or getattr(target.config, "_name_or_path", None) or None,
        )
        # Built on the CPU; with a seed, from a forked CPU generator: the caller's global RNG state is left as it
        # was (seed=None draws from the caller's stream). The same weights as a plain torch.manual_seed(seed) gave.
        with torch.random.fork_rng(devices=[], enabled=seed is not None), torch.device("cpu"):
            if seed is not None:
                torch.default_generator.manual_seed(seed)
            drafter = cls(config)
        drafter = drafter.to(dtype=target.dtype, device=target.device)
        with torch.no_grad():
            drafter.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
            drafter.lm_head.weight.copy_(head[ids.to(head.device)])
            final_norm = getattr(target.get_decoder(), "norm", None)
            if final_norm is not None and getattr(final_norm, "weight", None) is not None:
                drafter.norm.weight.copy_(final_norm.weight)
            drafter.draft_vocab_ids.copy_(ids)
        drafter.generation_config = target.generation_config.__class__.from_dict(target.generation_config.to_dict())
        return drafter.eval()

    def check_target(self, target: PreTrainedModel) -> None:
        """Refuse a target other than the one this drafter reads (model type, layers, hidden size, vocabulary)."""
        text, config = target.config.get_text_config(), self.config
        found = {
            "model_type": text.model_type,
            "num_hidden_layers": text.num_hidden_layers,
            "hidden_size": text.hidden_size,
            "vocab_size (embedding rows)": target.get_input_embeddings().weight.shape[0],
        }
        expected = {
            "model_type": config.target_model_type,
            "num_hidden_layers": config.target_num_hidden_layers,
            "hidden_size": config.target_hidden_size,
            "vocab_size (embedding rows)": config.vocab_size,
        }
        wrong = [f"{key}: drafter expects {expected[key]}, target has {found[key]}"
                 for key in found if expected[key] is not None and expected[key] != found[key]]
        if wrong:
            raise ValueError(
                f"This EAGLE-3 drafter was built for {config.target_name_or_path or 'another target'} and cannot read "
                f"this target's hidden states ({'; '.join(wrong)}). Use the target it was trained for, or build a "
                "drafter for this one with Eagle3DrafterForCausalLM.from_target(target)."
            )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target=None, **kwargs):
        """``PreTrainedModel.from_pretrained`` of a folder saved by ``save_pretrained``, checked against ``target``
        when given. SpecForge's and speculators' layouts are imported by the family
        (``ppow_trl.drafting.load_drafter`` / ``get_family("eagle3").load``, ``ppow_trl.drafters.eagle3.import_eagle3``)."""
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        model.embed_tokens.weight.requires_grad_(False)  # the target's embedding stays frozen after loading too
        if target is not None:
            model.check_target(target)
        return model

    # ----------------------------------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module):
        self.embed_tokens = value

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module):
        self.lm_head = new_embeddings

    def _head(self, hidden, logits_to_keep, full_vocab_logits):
        draft_logits = self.lm_head(self.norm(slice_logits_to_keep(hidden, logits_to_keep)))
        return draft_logits, (self.to_full_vocab(draft_logits) if full_vocab_logits else None)

    def _first_hidden(self, target_hidden_states, hidden_states):
        if (target_hidden_states is None) == (hidden_states is None):
            raise ValueError("Pass target_hidden_states (the target's features of real tokens) or hidden_states (the "
                             "drafter's own outputs fed back), exactly one of them.")
        if target_hidden_states is not None:
            if target_hidden_states.shape[-1] != self.config.feature_size:
                raise ValueError(
                    f"target_hidden_states has {target_hidden_states.shape[-1]} features; this drafter reads "
                    f"{self.config.feature_size} ({len(self.config.target_layer_ids)} layers x "
                    f"{self.config.target_hidden_size}). Capture them with ppow_trl.drafters.eagle3.target_features.")
            return self.fc(target_hidden_states.to(self.fc.weight.dtype))
        return hidden_states

    def forward(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: ChainCache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        full_vocab_logits: bool = True,
        unroll_steps: int | None = None,
        unroll_row_masks: list[torch.Tensor] | None = None,
        labels: torch.LongTensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Eagle3DrafterOutput:
        r"""
        input_ids (`(B, T)`): token ``s_{j+1}`` of each pair ``j``.
        target_hidden_states (`(B, T, feature_size)`): the target's features ``h_j`` (``target_features``), or
        hidden_states (`(B, T, hidden_size)`): the drafter's own outputs (``output.hidden_states``) fed back.
        attention_mask (`(B, past + T)`): 1 on real positions (left padding is 0); defaults to all ones.
        position_ids (`(B, T)`): defaults to ``past .. past + T - 1``.
        cache: a ``ChainCache`` holding ``past`` positions; created when ``use_cache`` and ``None``.
        unroll_steps: run ``unroll`` instead (training-time test over teacher-forced sequences, right padding,
            no cache) and return its steps' draft logits as ``unrolled_logits`` (at ``unroll_row_masks`` only, when
            given). Going through ``forward`` keeps PEFT and DDP wrappers in the call chain.
        labels (`(B, T)`): target ids of the token each pair predicts (``s_{j+2}``, ``-100`` ignored): cross-entropy
            on the full-width logits (infinite for a label outside the draft vocabulary); also what tells the
            ``Trainer`` this model takes labels.
        """
        if unroll_steps is not None:
            steps = self.unroll(input_ids, target_hidden_states, unroll_steps, attention_mask=attention_mask,
                                pad_token_id=self.config.pad_token_id or 0, row_masks=unroll_row_masks)
            return Eagle3DrafterOutput(unrolled_logits=tuple(steps))
        hidden = self._first_hidden(target_hidden_states, hidden_states)
        batch, length = input_ids.shape
        if use_cache and cache is None:
            cache = ChainCache(len(self.layers))
        past = 0 if cache is None else cache.get_seq_length()
        device = input_ids.device
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=device).unsqueeze(0).expand(batch, -1)
        if attention_mask is None:
            attention_mask = torch.ones((batch, past + length), dtype=torch.long, device=device)
        keys = torch.arange(past + length, device=device)
        queries = torch.arange(past, past + length, device=device)
        # causal and padding; each query also sees itself, so padded rows stay finite (they are never read)
        mask = (keys[None, :] <= queries[:, None])[None] & attention_mask.bool()[:, None, :]
        mask = (mask | (keys[None, :] == queries[:, None])[None]).unsqueeze(1)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(self.layers):
            hidden = layer(embeds, hidden, position_embeddings, cached_attention(cache, index, mask))
        draft_logits, logits = self._head(hidden, logits_to_keep, full_vocab_logits or labels is not None)
        loss = None
        if labels is not None:
            flat = labels.reshape(-1)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=-100)
        return Eagle3DrafterOutput(loss=loss, logits=logits, draft_logits=draft_logits, hidden_states=hidden,
                                   cache=cache if use_cache or cache is not None else None)

    def unroll(
        self,
        input_ids: torch.LongTensor,
        target_hidden_states: torch.Tensor,
        num_steps: int,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int = 0,
        row_masks: list[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        r"""Training-time test over teacher-forced sequences (module docstring): draft logits of steps ``0..n-1``.

        input_ids (`(B, T)`) and target_hidden_states (`(B, T, feature_size)`) are pair-aligned as in ``forward``
        (``input_ids[:, j] = s_{j+1}``, ``target_hidden_states[:, j] = h_j``); right padding only, masked by
        ``attention_mask``. Step ``k``'s logits at ``j`` (``(B, T, draft_vocab_size)``) predict ``s_{j+k+2}``; they
        are valid where ``j + k < T`` holds real tokens (the caller masks the rest). ``row_masks[k]`` (`(B, T)` bool):
        apply the head only to those pairs of step ``k`` (returns ``(N_k, draft_vocab_size)``; the head is most of the
        cost and training reads only response positions).
        """
        batch, length = input_ids.shape
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones((batch, length), dtype=torch.long, device=device)
        index = torch.arange(length, device=device)
        mask = ((index[None, :] <= index[:, None])[None] & attention_mask.bool()[:, None, :])
        mask = (mask | torch.eye(length, dtype=torch.bool, device=device)[None]).unsqueeze(1)
        # Steps >= 1 only continue chains whose logits some later step reads: their pairs are gathered into
        # `rows` (B, S), needed ones first in order (the rest of a row's S slots are never read); in training this
        # skips the prompt positions.
        rows = index.unsqueeze(0).expand(batch, -1)
        if row_masks is not None and num_steps > 1:
            needed = torch.stack(list(row_masks[1:num_steps])).any(0)
            count = int(needed.sum(-1).max()) if needed.any() else 1
            order = torch.argsort((~needed).to(torch.int8), dim=-1, stable=True)[:, :count]
            rows = order  # needed pairs first, in order
        hidden = self._first_hidden(target_hidden_states, None)
        chains = [[] for _ in self.layers]
        outputs = []
        for step in range(num_steps):
            if step == 1 and rows.shape[1] != length:
                hidden = hidden.gather(1, rows.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
                mask = mask.gather(2, rows[:, None, :, None].expand(-1, 1, -1, length))
            picked = index.unsqueeze(0).expand(batch, -1) if step == 0 else rows
            # token s_{j+step+1}: the input ids shifted left by `step`, padded at the end
            tokens = F.pad(input_ids, (0, step), value=pad_token_id).gather(1, picked + step)
            embeds = self.embed_tokens(tokens).to(hidden.dtype)
            position_embeddings = self.rotary_emb(hidden, picked + step)
            for layer_index, layer in enumerate(self.layers):
                hidden = layer(embeds, hidden, position_embeddings, unroll_attention(chains[layer_index], mask))
            if row_masks is None:
                selected = hidden
            else:
                wanted = row_masks[step] if step == 0 else row_masks[step].gather(1, rows)
                selected = hidden[wanted]
            outputs.append(self.lm_head(self.norm(selected)))
        return outputs


AutoConfig.register(Eagle3DrafterConfig.model_type, Eagle3DrafterConfig, exist_ok=True)
AutoModelForCausalLM.register(Eagle3DrafterConfig, Eagle3DrafterForCausalLM, exist_ok=True)
