"""DFlash block drafters to and from the layouts serving engines load.

Read from the projects' sources (z-lab ``dflash/model.py`` and SpecForge ``configs/qwen3-8b-dflash.json``;
speculators ``src/speculators/models/dflash`` and ``convert/dflash``; vLLM ``model_executor/models/qwen3_dflash.py``;
SGLang ``srt/models/dflash.py``); no engine was run here:

- ``"zlab"``: z-lab's ``DFlashDraftModel``, what vLLM (``method: dflash``) and SGLang (``DFLASH``) load.
  ``config.json`` is a Qwen3 config (``model_type: qwen3``, ``architectures: ["DFlashDraftModel"]``) with
  ``block_size``, ``num_target_layers`` and ``dflash_config: {mask_token_id, target_layer_ids}``; weights ``fc.*``,
  ``hidden_norm.*``, ``layers.*``, ``norm.*``, no embedding and no head (both are the target's). No ``auto_map``
  is written: z-lab's remote-code file is not ours to ship (engines do not need it).
- ``"speculators"``: vLLM's speculators format: ``speculators_model_type: "dflash"``, ``transformer_layer_config``,
  ``aux_hidden_state_layer_ids``, ``mask_token_id``, ``block_size``, ``speculators_config``; the same body plus
  ``embed_tokens.weight`` and ``lm_head.weight`` (the target's, given as ``target=``).
  ``speculators_config.verifier.name_or_path`` must name a model speculators (which reloads the embedding and head
  from it) and ``vllm serve <folder>`` can load: by default the path or Hub id the target was loaded from.
  Checked against speculators 0.9.0 itself when installed (``make interop``; ``tests/test_speculators_interop.py``):
  its ``DFlashDraftModel.from_pretrained`` loads this export with block logits equal to ours, and a drafter it saves
  imports back with equal logits. Reduced-vocabulary speculators drafters (``draft_vocab_size`` below the target's,
  ``d2t``/``t2d``) are refused on import: transformers' class drafts through the target's full head.

Conventions:

- Layer ids: transformers' ``MuseGlimmerAssistantConfig.target_layer_ids`` and z-lab's ``dflash_config.target_layer_ids``
  both name the decoder layer whose output is read (``hidden_states[i + 1]``); speculators' ``aux_hidden_state_layer_ids``
  are ``i + 1`` (vLLM converts them back).
- Renamed weights: ``encoder.fc`` <-> ``fc``, ``encoder.output_norm_enc`` <-> ``hidden_norm``; the math is the same
  (QK-norm before RoPE on ``[context, block]`` keys, pre-norm layers, final norm, the target's head).
- Attention: our drafters use full (non-sliding) bidirectional layers. vLLM and SGLang run layers marked
  ``sliding_attention`` causally unless told otherwise, so the export writes ``layer_types: full_attention``,
  ``use_sliding_window: false`` and ``is_causal: false`` (and ``dflash_config.causal: false``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

from ...models import resolve_verifier_name

FORMATS = ("zlab", "speculators")
_RENAMES = (("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))
_QWEN3_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps", "hidden_act", "max_position_embeddings", "vocab_size", "bos_token_id",
                 "eos_token_id", "pad_token_id")


def _layer_config(config) -> dict:
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    fields = {key: getattr(config, key, None) for key in _QWEN3_FIELDS}
    return {**fields, "model_type": "qwen3", "rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0),
            "rope_scaling": None if scaling.get("rope_type", "default") == "default" else scaling,
            "layer_types": ["full_attention"] * config.num_hidden_layers, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": config.num_hidden_layers, "attention_bias": False,
            "tie_word_embeddings": False}


def export_dflash(drafter, folder, *, format: str = "zlab", target=None, speculative_tokens: int | None = None,
                  verifier_name_or_path: str | None = None) -> Path:
    """Write a DFlash drafter (``MuseGlimmerAssistantModel``; merge a PEFT adapter first) in an engine layout
    (module docstring): ``config.json`` and ``model.safetensors``. ``format="speculators"`` needs ``target`` (its
    embedding and head are stored). ``speculative_tokens`` defaults to ``block_size - 1``. The speculators
    layout's verifier is ``verifier_name_or_path`` when given, else the path or Hub id ``target`` was loaded from,
    else the name recorded at build time (``resolve_verifier_name``). Returns the folder."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    drafter = getattr(drafter, "get_base_model", lambda: drafter)()
    if not isinstance(drafter, MuseGlimmerAssistantModel):
        raise TypeError(f"export_dflash takes a MuseGlimmerAssistantModel (merge a PEFT adapter first), got "
                        f"{type(drafter).__name__}.")
    config = drafter.config
    if any(kind != "full_attention" for kind in config.layer_types):
        raise ValueError("Only full-attention DFlash drafters are exported (engines run sliding layers causally).")
    weights = {}
    for key, value in drafter.state_dict().items():
        for old, new in _RENAMES:
            key = key.replace(old, new, 1) if key.startswith(old) else key
        weights[key] = value.detach().cpu().contiguous()
    ids = [int(i) for i in config.target_layer_ids]
    size, mask_id = int(config.block_size), int(config.mask_token_id)
    target_info = dict(getattr(config, "ppow_target", None) or {})
    dtype = str(drafter.dtype).removeprefix("torch.")
    if format == "zlab":
        out = {**_layer_config(config), "architectures": ["DFlashDraftModel"], "block_size": size,
               "num_target_layers": target_info.get("num_hidden_layers"), "is_causal": False, "torch_dtype": dtype,
               "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": ids, "block_size": size,
                                 "causal": False}}
    else:
        if target is None:
            raise ValueError("The speculators layout stores the target's embedding and head: pass target=.")
        weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu().contiguous()
        # a copy: tied targets share one tensor, which safetensors refuses to store twice
        weights["lm_head.weight"] = target.get_output_embeddings().weight.detach().cpu().clone()
        text = target.config.get_text_config()
        verifier = resolve_verifier_name(verifier_name_or_path, target, target_info.get("name_or_path"))
        if verifier is None:
            warnings.warn("No verifier name for the speculators export (neither the target nor the drafter records "
                          "one): speculators and `vllm serve <folder>` need one. Pass verifier_name_or_path=.",
                          stacklevel=2)
        out = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
               "transformer_layer_config": _layer_config(config), "draft_vocab_size": config.vocab_size,
               "block_size": size, "target_hidden_size": text.hidden_size,
               "aux_hidden_state_layer_ids": [i + 1 for i in ids], "mask_token_id": mask_id,
               "sliding_window_non_causal": True, "sample_from_anchor": False, "torch_dtype": dtype,
               "speculators_config": {
                   "algorithm": "dflash",
                   "proposal_methods": [{"proposal_type": "greedy",
                                         "speculative_tokens": int(speculative_tokens or size - 1)}],
                   "default_proposal_method": "greedy",
                   "verifier": {"name_or_path": verifier,
                                "architectures": list(getattr(target.config, "architectures", None) or [])}}}
    out["ppow_target"] = target_info  # what only ppow_trl reads back (engines ignore unknown keys)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    return folder


def detect_dflash_format(folder) -> str | None:
    """``"zlab"``, ``"speculators"``, ``"transformers"`` (``save_pretrained``) or ``None`` (not a DFlash folder)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    return layout_of_config(json.loads(path.read_text()))


def layout_of_config(config: dict) -> str | None:
    """The DFlash layout a ``config.json`` describes: ``"zlab"``, ``"speculators"``, ``"transformers"`` or ``None``."""
    if config.get("speculators_model_type") == "dflash":
        return "speculators"
    if config.get("model_type") == MuseGlimmerAssistantConfig.model_type:
        return "transformers"
    if "DFlashDraftModel" in (config.get("architectures") or []) or "dflash_config" in config:
        return "zlab"
    return None


def import_dflash(folder, *, target=None) -> MuseGlimmerAssistantModel:
    """Load a z-lab or speculators DFlash folder as transformers' ``MuseGlimmerAssistantModel`` (then usable with
    ``speculation_type="dflash"``, our loop and the trainers). ``target`` is checked against the recorded one."""
    folder = Path(folder)
    layout = detect_dflash_format(folder)
    if layout not in FORMATS:
        raise ValueError(f"{folder} is not a z-lab or speculators DFlash folder (config.json has no DFlashDraftModel "
                         "architecture, dflash_config, nor speculators_model_type 'dflash').")
    raw = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    if layout == "speculators":
        # Read the layer config as speculators does: the config class its model_type names (Qwen3Config when none)
        # built from the dict, so fields the dict leaves out take that class's defaults.
        from transformers import AutoConfig

        layer = dict(raw["transformer_layer_config"])
        layer = AutoConfig.for_model(layer.pop("model_type", None) or "qwen3", **layer).to_dict()
        ids = [int(i) - 1 for i in raw["aux_hidden_state_layer_ids"]]
        size, mask_id = int(raw["block_size"]), int(raw["mask_token_id"])
        draft_vocab = int(raw.get("draft_vocab_size") or layer["vocab_size"])
        if draft_vocab != int(layer["vocab_size"]) or "d2t" in weights or raw.get("sample_from_anchor"):
            raise ValueError(f"{folder} is a speculators DFlash drafter with a reduced draft vocabulary "
                             f"({draft_vocab} of {layer['vocab_size']} rows, its own lm_head and d2t) or "
                             "sample_from_anchor: transformers' DFlash class drafts through the target's full head "
                             "from the slots after the anchor, so it cannot be imported without changing its "
                             "predictions.")
    else:
        layer, extra = raw, raw.get("dflash_config") or {}
        ids = [int(i) for i in extra["target_layer_ids"]]
        size = int(extra.get("block_size") or raw["block_size"])
        mask_id = int(extra.get("mask_token_id", raw.get("mask_token_id")))
    if any(kind != "full_attention" for kind in layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        raise ValueError(f"{folder} has sliding-window layers; only full-attention DFlash drafters are imported.")
    rope = layer.get("rope_parameters") or {"rope_theta": layer.get("rope_theta", 10000.0),
                                            **(layer.get("rope_scaling") or {"rope_type": "default"})}
    fields = {key: layer[key] for key in _QWEN3_FIELDS if layer.get(key) is not None}
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    # token ids stay as recorded, None included (MuseGlimmerAssistantConfig's own defaults name another vocabulary)
    fields.update({key: layer.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")})
    config = MuseGlimmerAssistantConfig(**fields, rope_parameters=rope,
                                        layer_types=["full_attention"] * int(fields["num_hidden_layers"]),
                                        block_size=size, mask_token_id=mask_id, target_layer_ids=ids,
                                        ppow_target=raw.get("ppow_target") or {})
    state = {}
    for key, value in weights.items():
        if key in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"):
            continue  # the target's own (the drafter borrows them)
        for new, old in _RENAMES:
            key = key.replace(old, new, 1) if key.startswith(old) else key
        state[key] = value
    drafter = MuseGlimmerAssistantModel(config)
    missing, unexpected = drafter.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"{folder}: missing weights {missing}, unexpected {unexpected}.")
    if target is not None:
        from .modeling import check_target

        check_target(drafter, target)
    dtype = next(iter(state.values())).dtype if state else torch.float32
    return drafter.to(dtype if dtype.is_floating_point else torch.float32).eval()
