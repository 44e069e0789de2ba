"""The DFlash drafter family: block drafters (transformers' ``MuseGlimmerAssistantModel``) drafting a whole window
in one forward from the target's features, through the target's own embedding and head."""

from __future__ import annotations

import math

import torch
from transformers import GenerationConfig

from .._family_io import local_folder, read_config
from ...drafting import HUB_KWARGS, DrafterFamily
from ...features import target_features
from ...utils import unwrap_model
from .assisted import attach_block_window, load_block_drafter
from .configuration import choose_mask_token_id, hidden_state_indices
from .convert import export_dflash, import_dflash, layout_of_config
from .modeling import anchored_block_hidden, check_target, dflash_from_target, is_block_drafter
from .session import BlockSession, block_after_contexts


class DFlashFamily(DrafterFamily):
    """DFlash block drafters (module docstring). Saved in transformers' own layout (``save_pretrained``; no hook file:
    the native route ``speculation_type="dflash"`` takes the window rule as a hook on the drafter); imports and
    exports z-lab's and speculators' layouts. A base model without an LM head: PEFT's plain wrapper."""

    name = "dflash"
    description = "DFlash block drafter"
    peft_task_type = None
    cost_per_round = True
    hf_methods = ("hf_assisted",)  # stock transformers' speculation_type="dflash": the fixed block
    export_formats = ("zlab", "speculators")
    writes_hook_file = False
    reduced_head = False  # it drafts through the target's full head
    hf_generate_kwargs = {"speculation_type": "dflash"}
    reads_target = True
    runs_on_target = True

    def owns(self, model) -> bool:
        return is_block_drafter(model)

    def detect(self, folder_or_repo, **hub_kwargs) -> str | None:
        config = read_config(folder_or_repo, **hub_kwargs)
        return None if config is None else layout_of_config(config)

    def build(self, target, tokenizer=None, *, draft_vocab_ids=None, seed: int | None = 0,
              target_name_or_path: str | None = None, mask_token_id: int | None = None, block_size: int = 8,
              num_layers: int = 1, target_layer_ids: list[int] | None = None, **options):
        """A fresh block drafter (``dflash_from_target``); the mask token is chosen from ``tokenizer`` unless given.
        Full vocabulary: it drafts through the target's head (``draft_vocab_ids`` must be None)."""
        if options:
            raise ValueError(f"{sorted(options)} do not apply to DFlash drafters.")
        if draft_vocab_ids is not None:
            raise ValueError("A DFlash drafter drafts through the target's full head: set draft_vocab_size to 0.")
        if mask_token_id is None:
            if tokenizer is None:
                raise ValueError("A fresh DFlash drafter needs a mask token: pass tokenizer= or mask_token_id=.")
            mask_token_id = choose_mask_token_id(tokenizer)
        return dflash_from_target(target, mask_token_id=mask_token_id, block_size=block_size,
                                  num_hidden_layers=num_layers, target_layer_ids=target_layer_ids,
                                  target_name_or_path=target_name_or_path, seed=seed)

    def load(self, folder_or_repo, *, target=None, **from_pretrained_kwargs):
        hub_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in HUB_KWARGS}
        from_pretrained_kwargs.pop("trust_remote_code", None)  # transformers' own class: no remote code involved
        if self.detect(folder_or_repo, **hub_kwargs) == "transformers":
            model = load_block_drafter(str(folder_or_repo), **from_pretrained_kwargs)
        else:
            model = import_dflash(local_folder(folder_or_repo, **hub_kwargs), target=target)
        if target is not None:
            check_target(model, target)
        return model

    def export(self, drafter, folder, *, format: str, target=None, verifier_name_or_path: str | None = None):
        self.check_export_format(format)
        return export_dflash(unwrap_model(drafter), folder, format=format, target=target,
                             verifier_name_or_path=verifier_name_or_path)

    def session(self, drafter, target=None):
        if target is None:
            raise ValueError("A DFlash block drafter drafts with the target's embedding and output head: pass target=.")
        self.check_target(drafter, target)
        return BlockSession(drafter, target)

    def target_layer_ids(self, drafter) -> list[int]:
        return hidden_state_indices(unwrap_model(drafter).config)

    def check_target(self, drafter, target) -> None:
        check_target(unwrap_model(drafter), target)

    def input_vocab_size(self, drafter, target) -> int:
        return target.get_input_embeddings().num_embeddings  # it embeds with the target's embedding

    def describe(self, drafter) -> str:
        config = unwrap_model(drafter).config
        return (f"DFlash block drafter ({config.num_hidden_layers} layers, blocks of {config.block_size}, mask token "
                f"{config.mask_token_id}) reading target layers {list(config.target_layer_ids)}")

    # training -------------------------------------------------------------------------------------------
    def prepare_for_training(self, drafter, target=None) -> None:
        model = unwrap_model(drafter)
        if getattr(model, "generation_config", None) is None:
            model.generation_config = GenerationConfig()  # TRL writes its pad id there; the drafter never generates

    def window_hidden(self, drafter, contexts, inverse, window_ids, *, target=None, features=None):
        """One block per distinct context, anchored at its last token and reading the target's ``features`` of the
        others, with gradients; slot ``i`` gives ``q_i``, which does not depend on the drafted ``y_<i``, so every
        window of a context reads the same block."""
        hidden = block_after_contexts(drafter, target.get_input_embeddings(), contexts, features)
        return hidden[:, 1 : 1 + window_ids.shape[1]][inverse]

    def output_head(self, drafter, target=None) -> torch.nn.Module:
        return target.get_output_embeddings()

    def kd_rows(self, model, inputs, mask, args, target=None):
        """Anchored blocks (``KDConfig.block_anchors``): slot ``k`` of the block anchored at ``a`` predicts token
        ``a + k``, so it meets the teacher's distribution stored at position ``a + k - 1``."""
        ids, attention = inputs["input_ids"], inputs["attention_mask"]
        features = inputs.get("target_features")
        if features is None:
            features = target_features(target, ids, attention, self.target_layer_ids(model))
        block_size = int(unwrap_model(model).config.block_size)
        anchors = []
        for row in mask:
            candidates = row.nonzero().flatten()
            pick = torch.randperm(candidates.numel(), device=candidates.device)[: args.block_anchors]
            anchors.append(candidates[pick].sort().values)
        count = max(1, max(a.numel() for a in anchors))
        anchor_positions = torch.zeros((ids.shape[0], count), dtype=torch.long, device=ids.device)
        real = torch.zeros((ids.shape[0], count), dtype=torch.bool, device=ids.device)
        for row, chosen in enumerate(anchors):
            anchor_positions[row, : chosen.numel()], real[row, : chosen.numel()] = chosen, True
        hidden = anchored_block_hidden(model, target.get_input_embeddings(), features,
                                       ids.gather(1, anchor_positions), anchor_positions,
                                       context_valid=attention.bool())
        head = target.get_output_embeddings()
        rows = []
        for slot in range(1, block_size):
            teacher = (anchor_positions + slot - 1).clamp(max=ids.shape[1] - 1)
            scored = real & mask.gather(1, teacher) & (anchor_positions + slot - 1 < ids.shape[1])
            target_mask = torch.zeros_like(mask)
            target_mask[scored.nonzero(as_tuple=True)[0], teacher[scored]] = True
            # rows (sequence, anchor) ascending = the order target_mask selects the teacher's rows in
            rows.append((head(hidden[:, :, slot][scored].to(head.weight.dtype)), target_mask))
        return rows, {}  # no model output to hand the Trainer's prediction_step (it returns the loss only)

    def kd_slot_weights(self, args, num_slots: int) -> list[float]:
        """DFlash's ``exp(-(k - 1) / gamma)``."""
        return [math.exp(-step / args.block_decay_gamma) for step in range(num_slots)]

    def response_distributions(self, model, ids, mask, positions, keep, *, target=None, features=None,
                               feature_layers=None):
        """Column ``j``: slot 1 of the block anchored there, the first token of a window drafted after ``ids[:j+1]``."""
        device = ids.device
        columns = torch.arange(ids.shape[1] - keep, ids.shape[1] - 1, device=device)
        hidden = anchored_block_hidden(model, target.get_input_embeddings(), features.to(device), ids[:, columns],
                                       positions[:, columns], context_valid=mask.bool(), context_positions=positions)
        head = target.get_output_embeddings()
        return head(hidden[:, :, 1].to(head.weight.dtype)), None

    # serving --------------------------------------------------------------------------------------------
    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        if target is None:
            raise ValueError("This folder holds a DFlash block drafter: pass target= (e.g. load_assistant(folder, "
                             "target=target)) so its window rule can read the target's head.")
        attach_block_window(drafter, target, policy, vocab_size)
        return drafter

    def detach(self, drafter) -> None:
        window = getattr(drafter, "_ppow_block_window", None)
        if window is not None:
            window.remove()
