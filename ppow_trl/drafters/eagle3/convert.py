"""EAGLE-3 heads to and from the layouts serving engines and other trainers use.

Two layouts, read from those projects' sources (SpecForge ``specforge/modeling/draft/llama3_eagle.py`` and
``specforge/export``, speculators ``src/speculators/models/eagle3``, vLLM ``model_executor/models/llama_eagle3.py``,
SGLang ``srt/models/llama_eagle3.py``); no engine was run here:

- ``"specforge"``: SpecForge's ``LlamaForCausalLMEagle3``, what SGLang (``--speculative-algorithm EAGLE3``) and
  vLLM (``method: eagle3``) load. ``config.json`` is a Llama config with ``architectures:
  ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config:
  {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}``; weights ``fc.*``, ``midlayer.*``, ``norm.*``,
  ``lm_head.*``, ``d2t``, ``t2d`` (and ``embed_tokens.weight`` unless left out: engines share the target's).
- ``"speculators"``: vLLM's speculators format: ``speculators_model_type: "eagle3"``, ``speculators_config``
  (proposal method, verifier), ``transformer_layer_config``, weights ``layers.0.*`` instead of ``midlayer.*``.
  ``speculators_config.verifier.name_or_path`` must name a model speculators and ``vllm serve <folder>`` can load
  (``verifier_name_or_path``): by default the path or Hub id the target was loaded from.

Checked against the libraries themselves when installed (``make interop``; ``tests/test_speculators_interop.py``):
speculators 0.9.0's ``Eagle3DraftModel.from_pretrained`` loads the speculators export and SpecForge 0.2.0's
``LlamaForCausalLMEagle3`` the SpecForge export, with logits equal to ours over three training-time-test steps, and
checkpoints saved by either library import back with equal logits.

Conventions that differ between them (and from ours):

- Layer ids. Ours (``Eagle3DrafterConfig.target_layer_ids``) index HF's ``output_hidden_states`` tuple, as vLLM and
  speculators do. SpecForge/EAGLE/SGLang's ``eagle_aux_hidden_state_layer_ids`` name the decoder layer whose
  *output* is read, one less: ``specforge id = ours - 1``. The SpecForge export writes both: ``eagle_config`` in
  SpecForge's convention and a top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's (which vLLM reads first).
- Draft vocabulary: ``d2t[j] = target_id(j) - j`` (an offset) and ``t2d`` a boolean mask over the target
  vocabulary; ours is ``draft_vocab_ids`` (sorted target ids), so ``d2t = draft_vocab_ids - arange``.
- ``norm_before_residual`` is written ``false`` explicitly (vLLM defaults it to ``true`` for speculators configs).

Only one decoder layer (``midlayer``) is portable: both layouts and both engines build exactly one.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...models import resolve_verifier_name
from .configuration_eagle3 import Eagle3DrafterConfig
from .modeling_eagle3 import Eagle3DrafterForCausalLM

FORMATS = ("specforge", "speculators")
_LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "rms_norm_eps", "hidden_act", "max_position_embeddings", "vocab_size", "pad_token_id",
                 "bos_token_id", "eos_token_id")


def _rope_fields(config) -> dict:
    """RoPE as both ``rope_parameters`` (transformers 5) and the legacy ``rope_theta``/``rope_scaling`` (engines)."""
    rope = dict(config.rope_parameters or {})
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    legacy = None if scaling.get("rope_type", "default") == "default" else scaling
    return {"rope_parameters": rope, "rope_theta": rope.get("rope_theta", 10000.0), "rope_scaling": legacy}


def _layer_config(config: Eagle3DrafterConfig) -> dict:
    fields = {key: getattr(config, key) for key in _LLAMA_FIELDS}
    return {**fields, **_rope_fields(config), "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}


def _vocab_maps(drafter: Eagle3DrafterForCausalLM) -> tuple[torch.Tensor, torch.Tensor]:
    ids = drafter.draft_vocab_ids.cpu().long()
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def export_eagle3(drafter: Eagle3DrafterForCausalLM, folder, *, format: str = "specforge",
                  include_embeddings: bool = True, speculative_tokens: int | None = None, target=None,
                  verifier_name_or_path: str | None = None) -> Path:
    """Write ``drafter`` in an EAGLE-3 layout (module docstring) to ``folder``: ``config.json`` and
    ``model.safetensors``. ``include_embeddings=False`` leaves out ``embed_tokens.weight`` (engines share the
    target's; SpecForge's SGLang export does the same). ``speculative_tokens`` (speculators' proposal method)
    defaults to the drafter's saved window policy's ``K`` when it has one in ``generation_config``, else 3.

    speculators layout: ``speculators_config.verifier`` names ``verifier_name_or_path`` when given, else the path or
    Hub id ``target`` was loaded from, else the name recorded in the drafter's config (``resolve_verifier_name``);
    its ``architectures`` are ``target``'s when given. Returns the folder."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}.")
    drafter = getattr(drafter, "get_base_model", lambda: drafter)()
    if not isinstance(drafter, Eagle3DrafterForCausalLM):
        raise TypeError(f"export_eagle3 takes an Eagle3DrafterForCausalLM (merge a PEFT adapter first), got "
                        f"{type(drafter).__name__}.")
    config = drafter.config
    if config.num_hidden_layers != 1:
        raise ValueError(f"EAGLE-3 layouts hold one decoder layer (midlayer); this drafter has {config.num_hidden_layers}.")
    if config.attention_bias or config.mlp_bias:
        raise ValueError("EAGLE-3 layouts have no attention or MLP biases; this drafter has them.")
    state = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != "draft_vocab_ids"}
    d2t, t2d = _vocab_maps(drafter)
    layer = "midlayer." if format == "specforge" else "layers.0."
    weights = {key.replace("layers.0.", layer, 1): value for key, value in state.items()
               if include_embeddings or not key.startswith("embed_tokens.")}
    weights.update(d2t=d2t, t2d=t2d)
    ours = list(config.target_layer_ids)
    if format == "speculators" and len(set(ours)) != len(ours):
        warnings.warn(f"target_layer_ids {ours} repeat a layer: speculators refuses such a checkpoint (its layer ids "
                      "must be distinct).", stacklevel=2)
    if format == "specforge" and len(ours) != 3:
        warnings.warn(f"SpecForge and SGLang build fc for exactly 3 target layers; this drafter reads {len(ours)}.",
                      stacklevel=2)
    common = {"draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
              "norm_before_residual": False, "torch_dtype": str(drafter.dtype).removeprefix("torch.")}
    if format == "specforge":
        out = {**_layer_config(config), **common, "architectures": ["LlamaForCausalLMEagle3"],
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in ours], "use_aux_hidden_state": True},
               "eagle_aux_hidden_state_layer_ids": ours}
    else:
        policy = (getattr(drafter.generation_config, "ppow_window_policy", None) or {})
        tokens = speculative_tokens or policy.get("max_window") or 3
        verifier = resolve_verifier_name(verifier_name_or_path, target, config.target_name_or_path)
        if verifier is None:
            warnings.warn("No verifier name for the speculators export (neither the target nor the drafter records "
                          "one): speculators and `vllm serve <folder>` need one. Pass verifier_name_or_path=.",
                          stacklevel=2)
        architectures = list(getattr(getattr(target, "config", None), "architectures", None) or
                             [_target_architecture(config)])
        out = {**common, "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "speculators_config": {
                   "algorithm": "eagle3",
                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(tokens),
                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                   "default_proposal_method": "greedy",
                   "verifier": {"name_or_path": verifier,
                                "architectures": architectures}},
               "transformer_layer_config": _layer_config(config), "eagle_aux_hidden_state_layer_ids": ours,
               "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False}
    # What only ppow_trl reads back: the target the drafter was built for (engines ignore unknown keys).
    out["ppow_trl"] = {"target_model_type": config.target_model_type,
                       "target_num_hidden_layers": config.target_num_hidden_layers,
                       "target_name_or_path": config.target_name_or_path, "full_vocab_size": config.full_vocab_size}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(out, indent=2) + "\n")
    return folder


def _target_architecture(config) -> str:
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "mistral": "MistralForCausalLM"}
    return names.get(config.target_model_type, "AutoModelForCausalLM")


def _load_weights(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():  # the original EAGLE trainer's checkpoints
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor pytorch_model.bin.")


def detect_format(folder) -> str | None:
    """``"specforge"``, ``"speculators"`` or ``None`` (not an EAGLE-3 layout: e.g. our own save_pretrained)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    return layout_of_config(json.loads(path.read_text()))


def layout_of_config(config: dict) -> str | None:
    """The EAGLE-3 export layout a ``config.json`` describes: ``"specforge"``, ``"speculators"`` or ``None``."""
    if config.get("speculators_model_type") == "eagle3":
        return "speculators"
    if config.get("model_type") == Eagle3DrafterConfig.model_type:
        return None  # ours (save_pretrained): loaded by transformers as usual
    if "LlamaForCausalLMEagle3" in (config.get("architectures") or []) or (
            "draft_vocab_size" in config and config.get("model_type") == "llama"):
        return "specforge"
    return None


def import_eagle3(folder, *, target=None, target_layer_ids: list[int] | None = None) -> Eagle3DrafterForCausalLM:
    """Load a SpecForge- or speculators-layout EAGLE-3 head (a folder) as an ``Eagle3DrafterForCausalLM``.

    ``target`` (the model it drafts for) fills what a checkpoint may lack: the embedding (engines share the
    target's, so exports often leave it out), the layer ids when the config names none (EAGLE-3's defaults for the
    target's depth) and the target description checked on use. ``target_layer_ids`` (HF ``output_hidden_states``
    indices) overrides the config's."""
    folder = Path(folder)
    layout = detect_format(folder)
    if layout is None:
        raise ValueError(f"{folder} is not a SpecForge or speculators EAGLE-3 folder (config.json has no "
                         "LlamaForCausalLMEagle3 architecture nor speculators_model_type 'eagle3').")
    raw = json.loads((folder / "config.json").read_text())
    layer = raw
    if layout == "speculators":
        # Read the layer config as speculators does: the config class its model_type names (Qwen3Config when none)
        # built from the dict, so fields the dict leaves out take that class's defaults.
        from transformers import AutoConfig

        layer = dict(raw["transformer_layer_config"])
        layer = AutoConfig.for_model(layer.pop("model_type", None) or "qwen3", **layer).to_dict()
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{folder} has {layer['num_hidden_layers']} draft layers; only one (midlayer) is supported.")
    weights = _load_weights(folder)
    prefix = "midlayer." if layout == "specforge" else "layers.0."
    unknown = [k for k in weights if not k.startswith((prefix, "fc.", "norm.", "lm_head.", "embed_tokens.", "d2t", "t2d"))]
    if unknown:
        raise ValueError(f"{folder} holds weights this drafter has no place for: {unknown[:5]} (fc_norm / "
                         "norm_before_fc variants are not supported).")
    if raw.get("norm_before_residual") or raw.get("norm_before_fc") or raw.get("fc_norm"):
        raise ValueError(f"{folder} uses norm_before_residual / norm_before_fc / fc_norm, which this drafter does not "
                         "implement.")
    # `norm_output` means opposite things in the two projects: speculators' True feeds the *normed* state back across
    # drafting steps (EAGLE 3.1); SpecForge's False drops the final norm before the head. Ours is neither.
    norm_output = raw.get("norm_output")
    if (layout == "speculators" and norm_output) or (layout == "specforge" and norm_output is False):
        raise ValueError(f"{folder} sets norm_output={norm_output} ({layout}), a variant this drafter does not "
                         "implement (it feeds back the state before the final norm and applies that norm before "
                         "the head).")
    ours = raw.get("ppow_trl", {})
    layer_ids = target_layer_ids or raw.get("eagle_aux_hidden_state_layer_ids")
    if layer_ids is None and "eagle_config" in raw:
        layer_ids = [i + 1 for i in raw["eagle_config"].get("eagle_aux_hidden_state_layer_ids") or []] or None
    text = None if target is None else target.config.get_text_config()
    if layer_ids is None:
        if text is None:
            raise ValueError(f"{folder} names no target layers: pass target= (EAGLE-3's defaults for its depth) or "
                             "target_layer_ids=.")
        from .configuration_eagle3 import default_target_layer_ids

        layer_ids = default_target_layer_ids(text.num_hidden_layers)
    fields = {key: layer[key] for key in _LLAMA_FIELDS if layer.get(key) is not None}
    rope = layer.get("rope_parameters") or {"rope_theta": layer.get("rope_theta", 10000.0),
                                            **(layer.get("rope_scaling") or {"rope_type": "default"})}
    vocab = int(fields["vocab_size"])
    config = Eagle3DrafterConfig(
        **fields, rope_parameters=rope, num_hidden_layers=1, draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        full_vocab_size=ours.get("full_vocab_size") or vocab,
        target_hidden_size=raw.get("target_hidden_size") or fields["hidden_size"], target_layer_ids=list(layer_ids),
        target_num_hidden_layers=ours.get("target_num_hidden_layers") or (text and text.num_hidden_layers),
        target_model_type=ours.get("target_model_type") or (text and text.model_type),
        target_name_or_path=ours.get("target_name_or_path") or
        raw.get("speculators_config", {}).get("verifier", {}).get("name_or_path"),
    )
    drafter = Eagle3DrafterForCausalLM(config)
    state = {key.replace(prefix, "layers.0.", 1): value for key, value in weights.items() if key not in ("d2t", "t2d")}
    if "embed_tokens.weight" not in state:
        if target is None:
            raise ValueError(f"{folder} has no embed_tokens.weight (engines share the target's): pass target=.")
        state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().cpu()
    d2t = weights.get("d2t")
    ids = torch.arange(config.draft_vocab_size) + (0 if d2t is None else d2t.long())
    state["draft_vocab_ids"] = ids
    dtype = next(iter(weights.values())).dtype if weights else torch.float32
    missing, unexpected = drafter.load_state_dict({k: v.to(torch.float32) if v.is_floating_point() else v
                                                   for k, v in state.items()}, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise ValueError(f"{folder}: missing weights {missing}, unexpected {unexpected}.")
    if target is not None:
        drafter.check_target(target)
    floating = dtype if dtype.is_floating_point else torch.float32
    return drafter.to(floating).eval()
