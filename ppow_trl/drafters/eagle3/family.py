"""The EAGLE-3 drafter family: heads that read the target's hidden states and draft as a chain."""

from __future__ import annotations

import torch

from .._family_io import local_folder, read_config
from ...batching import positions_from_mask
from ...drafting import HUB_KWARGS, DrafterFamily
from ...features import target_features
from ...utils import unwrap_model
from .assisted import attach_to_target
from .configuration_eagle3 import Eagle3DrafterConfig, resolve_target_layer_ids
from .convert import export_eagle3, import_eagle3, layout_of_config
from .modeling_eagle3 import Eagle3DrafterForCausalLM
from .session import ChainSession, context_pairs


class Eagle3Family(DrafterFamily):
    """``Eagle3DrafterForCausalLM`` (SpecForge's architecture): one fused layer over ``fc(h)`` of the target's
    features and the token embedding, a reduced-vocabulary head. Saved with ``save_pretrained``; imports and exports
    SpecForge's and speculators' layouts. In ``target.generate(assistant_model=...)`` through hooks on the target
    (``attach_to_target``), never through HF's own assistant schedules (they hand it token ids only)."""

    name = "eagle3"
    description = "EAGLE-3 head reading the target's hidden states"
    hf_methods = ()
    export_formats = ("specforge", "speculators")
    reads_target = True

    def owns(self, model) -> bool:
        return isinstance(model, Eagle3DrafterForCausalLM)

    def detect(self, folder_or_repo, **hub_kwargs) -> str | None:
        config = read_config(folder_or_repo, **hub_kwargs)
        if config is None:
            return None
        if config.get("model_type") == Eagle3DrafterConfig.model_type:
            return "transformers"
        return layout_of_config(config)

    def build(self, target, tokenizer=None, *, draft_vocab_ids=None, seed: int | None = 0,
              target_name_or_path: str | None = None, target_layer_ids: list[int] | None = None,
              num_layers: int = 1, **options):
        """A fresh head shaped like one layer of ``target`` (``Eagle3DrafterForCausalLM.from_target``)."""
        if options:
            raise ValueError(f"{sorted(options)} do not apply to EAGLE-3 drafters.")
        return Eagle3DrafterForCausalLM.from_target(target, draft_vocab_ids=draft_vocab_ids,
                                                    target_layer_ids=target_layer_ids, num_hidden_layers=num_layers,
                                                    target_name_or_path=target_name_or_path, seed=seed)

    def planned_layer_ids(self, target, *, target_layer_ids: list[int] | None = None, **build_options) -> list[int]:
        return resolve_target_layer_ids(target.config.get_text_config().num_hidden_layers, target_layer_ids)

    def load(self, folder_or_repo, *, target=None, **from_pretrained_kwargs):
        hub_kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in HUB_KWARGS}
        layout = self.detect(folder_or_repo, **hub_kwargs)
        if layout in self.export_formats:
            return import_eagle3(local_folder(folder_or_repo, **hub_kwargs), target=target)
        from_pretrained_kwargs.pop("trust_remote_code", None)  # our own class: no remote code involved
        model = Eagle3DrafterForCausalLM.from_pretrained(str(folder_or_repo), **from_pretrained_kwargs)
        if target is not None:
            model.check_target(target)
        return model

    def export(self, drafter, folder, *, format: str, target=None, verifier_name_or_path: str | None = None):
        self.check_export_format(format)
        return export_eagle3(unwrap_model(drafter), folder, format=format, target=target,
                             verifier_name_or_path=verifier_name_or_path)

    def session(self, drafter, target=None):
        if target is not None:
            self.check_target(drafter, target)
        return ChainSession(drafter)

    def target_layer_ids(self, drafter) -> list[int]:
        return list(unwrap_model(drafter).config.target_layer_ids)

    def check_target(self, drafter, target) -> None:
        unwrap_model(drafter).check_target(target)

    def describe(self, drafter) -> str:
        config = unwrap_model(drafter).config
        return (f"EAGLE-3 head reading target hidden states {list(config.target_layer_ids)}, "
                f"{config.draft_vocab_size}-token head")

    # training -------------------------------------------------------------------------------------------
    def window_hidden(self, drafter, contexts, inverse, window_ids, *, target=None, features=None):
        """The chain replayed with gradients as the rollout drafted it (``ChainSession``): each distinct context's
        pairs ``(h_j, c_{j+1})`` once from the target's ``features``, its cache repeated for the windows sharing
        it, then one step per window token on the drafter's own hidden state. Returns the normed states the head
        reads (``lm_head(norm(x))``)."""
        model = unwrap_model(drafter)
        device = model.fc.weight.device
        ids, mask, feats, positions = context_pairs(contexts, features, 0, device)
        out = drafter(input_ids=ids, target_hidden_states=feats, attention_mask=mask, position_ids=positions,
                      use_cache=True, logits_to_keep=1, full_vocab_logits=False)
        cache, hidden = out.cache, out.hidden_states[:, -1:][inverse]
        cache.batch_select_indices(inverse)  # differentiable: each window reads its context's keys and values
        mask, position = mask[inverse], positions[:, -1:][inverse]
        states = [hidden]
        for step in range(window_ids.shape[1] - 1):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            position = position + 1
            out = drafter(input_ids=window_ids[:, step : step + 1].to(device), hidden_states=hidden,
                          attention_mask=mask, position_ids=position, cache=cache, use_cache=True,
                          full_vocab_logits=False)
            cache, hidden = out.cache, out.hidden_states
            states.append(hidden)
        return model.norm(torch.cat(states, dim=1))

    def kd_rows(self, model, inputs, mask, args, target=None):
        """Training-time test: step ``k``'s logits at pair ``j`` predict the token after sequence position
        ``t = j + k + 1``, so they meet the teacher's distribution stored at ``t``."""
        ids, attention = inputs["input_ids"], inputs["attention_mask"]
        features = inputs.get("target_features")  # cached (compute_target_features), else computed now
        if features is None:
            features = target_features(target, ids, attention, self.target_layer_ids(model))
        target_masks, pair_masks = [], []
        for step in range(args.ttt_steps):
            # teacher position t <-> pair j = t - step - 1 (pairs exist for t >= step + 1)
            target_mask = mask.clone()
            target_mask[:, : step + 1] = False
            pair_mask = torch.nn.functional.pad(target_mask[:, step + 1 :], (0, step))
            target_masks.append(target_mask)
            pair_masks.append(pair_mask)
        outputs = model(input_ids=ids[:, 1:], target_hidden_states=features[:, :-1], attention_mask=attention[:, 1:],
                        unroll_steps=args.ttt_steps, unroll_row_masks=pair_masks)
        return list(zip(outputs.unrolled_logits, target_masks)), outputs

    def kd_slot_weights(self, args, num_slots: int) -> list[float]:
        """TTT's ``ttt_decay ** (k - 1)``."""
        return [args.ttt_decay**step for step in range(num_slots)]

    def response_distributions(self, model, ids, mask, positions, keep, *, target=None, features=None,
                               feature_layers=None):
        """Pairs ``(h_j, s_{j+1})`` from the target's ``features``: column ``j`` predicts what the target's column
        ``j + 1`` does, so the same last columns line up."""
        device = ids.device
        out = model(input_ids=ids[:, 1:], target_hidden_states=features[:, :-1].to(device), attention_mask=mask[:, 1:],
                    position_ids=positions_from_mask(mask[:, 1:]), logits_to_keep=keep)
        return out.logits[:, -keep:-1], None

    # serving --------------------------------------------------------------------------------------------
    def attach(self, drafter, target, policy, vocab_size: int | None = None):
        if target is None:
            raise ValueError("This drafter reads the target's hidden states: pass target= (e.g. load_assistant("
                             "folder, target=target)) so it can hook the target.")
        attach_to_target(drafter, target, policy, vocab_size)
        return drafter

    def detach(self, drafter) -> None:
        tap = getattr(drafter, "_ppow_feature_tap", None)
        if tap is not None:
            tap.remove()
