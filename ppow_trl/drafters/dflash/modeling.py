"""DFlash block drafters: transformers' ``MuseGlimmerAssistantModel`` driven by the target's embedding and head.

One forward drafts a block. For an anchor token ``x_a`` (the last committed token, whose target features are not
known yet) the drafter reads ``[x_a, m, ..., m]`` (``block_size`` positions ``a .. a + block_size - 1``, ``m`` the
mask token, all embedded by the target's input embedding), attends bidirectionally inside the block and to the
target's features ``h_j`` (``cat`` of ``config.target_layer_ids``' outputs, projected by ``encoder``) of every
position ``j < a``; slot ``k`` (``k = 1 .. block_size - 1``) goes through the target's output head and predicts
``x_{a + k}``. Nothing in slot ``k``'s input depends on the drafted ``y_<k``: its distribution ``q_k`` is fixed
by the context, so a prefix of the block is a valid speculative-sampling proposal of any length.

``anchored_block_hidden`` is the one uncached forward over many blocks at once (each with its own anchor and
context prefix, through a block mask): KD's anchored-block objective, teacher-forced windows (exact greedy tau),
batched rollouts and PPOW's loss all call it. Generation runs the cached form (``DFlashCache``, one block per
round) in ``ppow_trl.drafters.dflash.session.BlockSession``, the same calls transformers' ``DFlashTokenCandidateGenerator`` makes.
"""

from __future__ import annotations

import torch
from transformers import MuseGlimmerAssistantModel, PreTrainedModel

from ...utils import unwrap_model
from .configuration import dflash_config_for, hidden_state_indices


def is_block_drafter(model) -> bool:
    """Whether ``model`` (unwrapped) is a DFlash block drafter."""
    return isinstance(model, MuseGlimmerAssistantModel)


def dflash_from_target(
    target: PreTrainedModel,
    *,
    mask_token_id: int,
    block_size: int = 8,
    num_hidden_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    target_name_or_path: str | None = None,
    seed: int | None = 0,
) -> MuseGlimmerAssistantModel:
    """A fresh block drafter for ``target`` (``dflash_config_for``): random layers and ``encoder.fc`` (``seed``),
    the final norm copied from the target's (its outputs feed the target's head, which expects normed states)."""
    config = dflash_config_for(target, mask_token_id=mask_token_id, block_size=block_size,
                               num_hidden_layers=num_hidden_layers, target_layer_ids=target_layer_ids,
                               target_name_or_path=target_name_or_path)
    # Built on the CPU; with a seed, from a forked CPU generator: the caller's global RNG state is left as it was
    # (seed=None draws from the caller's stream). The same weights as a plain torch.manual_seed(seed) gave.
    with torch.random.fork_rng(devices=[], enabled=seed is not None), torch.device("cpu"):
        if seed is not None:
            torch.default_generator.manual_seed(seed)
        drafter = MuseGlimmerAssistantModel(config)
    drafter = drafter.to(dtype=target.dtype, device=target.device)
    final_norm = getattr(target.get_decoder(), "norm", None)
    if final_norm is not None and getattr(final_norm, "weight", None) is not None:
        with torch.no_grad():
            drafter.norm.weight.copy_(final_norm.weight)
    return drafter


def check_target(drafter, target: PreTrainedModel) -> None:
    """Refuse a target other than the one ``drafter`` reads (type, depth, width, vocabulary), saying what differs."""
    config = drafter.config
    text = target.config.get_text_config()
    expected = dict(getattr(config, "ppow_target", None) or {})
    found = {"model_type": text.model_type, "num_hidden_layers": text.num_hidden_layers,
             "hidden_size": text.hidden_size, "vocab_size": target.get_input_embeddings().weight.shape[0]}
    expected.setdefault("hidden_size", config.hidden_size)
    wrong = [f"{key}: drafter expects {expected[key]}, target has {found[key]}"
             for key in found if expected.get(key) is not None and expected[key] != found[key]]
    if max(config.target_layer_ids) >= text.num_hidden_layers:
        wrong.append(f"target_layer_ids {list(config.target_layer_ids)} exceed its {text.num_hidden_layers} layers")
    if wrong:
        raise ValueError(f"This DFlash drafter was built for {expected.get('name_or_path') or 'another target'} and "
                         f"cannot read this target ({'; '.join(wrong)}). Use the target it was trained for, or build "
                         "one for this target with ppow_trl.drafters.dflash.dflash_from_target(target, mask_token_id=...).")


def block_mask(context_valid: torch.Tensor, context_positions: torch.Tensor, anchor_positions: torch.Tensor,
               block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask ``(B, 1, n * S, C + n * S)`` of ``n`` blocks of ``S = block_size`` per row.

    Query slot of block ``b`` sees context row ``j`` iff ``context_valid[j]`` and ``context_positions[j] <
    anchor_positions[b]`` (features strictly before its anchor), and every slot of its own block; nothing else
    (0 where allowed, the dtype's minimum elsewhere).
    """
    batch, blocks = anchor_positions.shape
    sees_context = context_valid[:, None, :] & (context_positions[:, None, :] < anchor_positions[:, :, None])
    sees_context = sees_context.repeat_interleave(block_size, dim=1)  # (B, n * S, C)
    block_of = torch.arange(blocks * block_size, device=anchor_positions.device) // block_size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    allowed = torch.cat([sees_context, sees_block], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def block_input_ids(anchor_ids: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """``[x_a, m, ..., m]`` per anchor: ``(B, n) -> (B, n * block_size)``."""
    ids = anchor_ids.new_full((*anchor_ids.shape, block_size), mask_token_id)
    ids[..., 0] = anchor_ids
    return ids.flatten(1)


def anchored_block_hidden(
    drafter,
    input_embeddings: torch.nn.Module,
    context_features: torch.Tensor,
    anchor_ids: torch.Tensor,
    anchor_positions: torch.Tensor,
    *,
    context_valid: torch.Tensor | None = None,
    context_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Output states of ``n`` blocks per row, each anchored at ``anchor_positions`` ``(B, n)``: ``(B, n, S, H)``.

    ``context_features`` ``(B, C, F)``: the target's features of positions ``context_positions`` (default
    ``0..C-1``); ``context_valid`` ``(B, C)`` marks real rows (default all). Block ``b`` reads the features of
    positions ``< anchor_positions[b]`` (``block_mask``). Slot ``k >= 1`` of a block predicts the token at
    ``anchor + k``; ``drafter`` may be wrapped (PEFT) and is called as transformers calls it.
    """
    config = getattr(drafter, "config", None) or base_config(drafter)
    size, mask_id = int(config.block_size), int(config.mask_token_id)
    batch, width = context_features.shape[:2]
    device = context_features.device
    if context_positions is None:
        context_positions = torch.arange(width, device=device).expand(batch, -1)
    if context_valid is None:
        context_valid = torch.ones((batch, width), dtype=torch.bool, device=device)
    ids = block_input_ids(anchor_ids, size, mask_id)
    embeds = input_embeddings(ids)
    slots = torch.arange(size, device=device)
    positions = torch.cat([context_positions, (anchor_positions[:, :, None] + slots).flatten(1)], dim=-1)
    mask = block_mask(context_valid.bool(), context_positions, anchor_positions, size, embeds.dtype)
    out = drafter(noise_embeds=embeds, context_hidden_states=context_features.to(embeds.dtype),
                  attention_mask={"full_attention": mask, "sliding_attention": mask}, position_ids=positions)
    return out.last_hidden_state.view(batch, anchor_ids.shape[1], size, -1)


def base_config(drafter):
    return unwrap_model(drafter).config


def feature_layers(drafter) -> list[int]:
    """The target hidden-state indices ``drafter`` reads (``target_layer_ids + 1``)."""
    return hidden_state_indices(base_config(drafter))
