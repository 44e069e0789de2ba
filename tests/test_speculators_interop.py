"""Our EAGLE-3 and DFlash exports against the libraries that consume them, loaded by their own classes.

speculators (vLLM's checkpoint format) and SpecForge are installed by `make interop` (both with ``--no-deps``: their
declared pins, torchvision/torchaudio and ``transformers<=5.19`` / ``torch==2.11`` + sglang, would replace this
project's torch and transformers). Everything runs on the CPU, offline, on tiny models: the verifier is a tiny Llama
saved to a local folder, which is what the exports name by default.

What is checked, in both directions (ours -> theirs, theirs -> ours):

- speculators' ``Eagle3DraftModel.from_pretrained`` loads our speculators-layout EAGLE-3 export (with and without the
  embedding, tied and untied targets) and computes our logits at every training-time-test step;
- speculators' ``DFlashDraftModel.from_pretrained`` loads our speculators-layout DFlash export and computes our block
  logits;
- drafters built and saved by speculators' classes import into ours (``load_drafter``) with equal logits;
- speculators' pydantic config classes accept our ``config.json`` (no unknown key), and the fields vLLM reads from it
  (its ``speculators`` config adapter, re-stated below) say what our drafter does;
- SpecForge's ``LlamaForCausalLMEagle3`` loads our SpecForge-layout export strictly, computes our logits, and a head
  it saves imports into ours.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import make_tiny_llama
from safetensors.torch import load_file

pytest.importorskip(
    "speculators.models.eagle3",
    reason="speculators is not installed: run `make interop` (pip install --no-deps speculators==0.9.0 "
           "hs-connectors==0.9.0, then pip install openai loguru)",
)
from speculators import SpeculatorModelConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    Qwen3Config,
)

from ppow_trl.drafters.dflash import dflash_from_target, export_dflash, feature_layers
from ppow_trl.drafters.dflash.modeling import anchored_block_hidden
from ppow_trl.drafting import get_family, load_drafter
from ppow_trl.drafters.eagle3 import (
    Eagle3DrafterForCausalLM,
    export_eagle3,
    import_eagle3,
    target_features,
)

LAYERS = [2, 3, 6]  # hidden-state indices of a 6-layer target (distinct: speculators refuses repeated ids)
USED = torch.tensor(sorted({3, 5, 8, 13, 21, 34, 55, 60, *range(10, 20)}))  # a reduced draft vocabulary
MASK_ID, BLOCK = 7, 4


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No test here may reach the Hub: every name the libraries resolve is a local folder."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def verifiers(tmp_path_factory):
    """Tiny 6-layer Llamas saved to folders and loaded back from them (so ``config._name_or_path`` is that folder, as
    for any target loaded from disk or the Hub), by ``tie_word_embeddings``. Tied: SmolLM2-like, the folder holds no
    ``lm_head.weight``."""
    out = {}
    for tied in (True, False):
        folder = tmp_path_factory.mktemp("tied" if tied else "untied")
        make_tiny_llama(num_layers=6, seed=0, initializer_range=0.5, tie_word_embeddings=tied).save_pretrained(folder)
        assert ("lm_head.weight" in load_file(str(folder / "model.safetensors"))) is not tied
        target = AutoModelForCausalLM.from_pretrained(folder).eval()
        assert target.config._name_or_path == str(folder)
        out[tied] = {"folder": folder, "target": target}
    return out


@pytest.fixture
def verifier(verifiers):
    return verifiers[True]


TIED = pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])


def _perturb_norms(model, seed: int = 1):
    """Norm weights away from 1, so a norm applied in the wrong place changes the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def _randomize(model, seed: int = 1, skip=("embed_tokens", "lm_head", "verifier_")):
    """Random weights everywhere but the target-owned matrices, norms away from 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(skip):
                continue
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _head(target):
    return _perturb_norms(Eagle3DrafterForCausalLM.from_target(target, draft_vocab_ids=USED, target_layer_ids=LAYERS))


def _pairs(target, length: int, seed: int = 0):
    """EAGLE-3's training pairs of one random sequence: tokens ``s_{j+1}`` and the target's features ``h_j``."""
    g = torch.Generator().manual_seed(seed)
    sequence = torch.randint(8, 60, (1, length + 1), generator=g)
    features = target_features(target, sequence, layer_ids=LAYERS)
    return sequence[:, 1:], features[:, :-1]


def _speculators_ttt_logits(model, ids, hidden, steps: int):
    """speculators' own training-time-test forward (it returns argmax tokens): the draft logits of every step, read
    from its lm_head."""
    captured = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    try:
        with torch.no_grad():
            model(hidden_states=hidden, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=steps)
    finally:
        hook.remove()
    return captured


def _assert_ttt_equal(theirs, ours, length: int):
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        # step k is valid at pairs j with j + k inside the sequence (both pad the rest differently)
        assert torch.isfinite(a[0, : length - step]).all()
        torch.testing.assert_close(a[0, : length - step], b[0, : length - step], atol=1e-5, rtol=1e-5)


def _load_speculators(model_class, config_class, folder, attention="eager"):
    config = config_class.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = attention
    return model_class.from_pretrained(str(folder), config=config).eval()


def _assert_same_weights(model, folder):
    """Every tensor of the checkpoint landed, unchanged, in the library's model (no renamed or dropped key)."""
    state = model.state_dict()
    for key, value in load_file(str(folder / "model.safetensors")).items():
        assert key in state, f"{key} has no place in {type(model).__name__}"
        assert torch.equal(state[key].to(value.dtype), value), key


# ---------------------------------------------------------------------------------------------------------------
# EAGLE-3, speculators layout
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("include_embeddings", [True, False], ids=["with-embedding", "no-embedding"])
@TIED
def test_eagle3_export_loads_in_speculators_with_our_logits(verifiers, tied, include_embeddings, tmp_path):
    verifier = verifiers[tied]
    target = verifier["target"]
    head = _head(target)
    folder = export_eagle3(head, tmp_path, format="speculators", include_embeddings=include_embeddings)
    raw = json.loads((folder / "config.json").read_text())
    # the default verifier is the folder the target was loaded from (recorded by from_target), made absolute
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(verifier["folder"].resolve())

    model = _load_speculators(Eagle3DraftModel, Eagle3SpeculatorConfig, folder)
    _assert_same_weights(model, folder)
    if not include_embeddings:
        # speculators refills a missing embedding from the verifier only where it is still its NaN marker; under
        # transformers 5.24 (it pins <=5.19) from_pretrained leaves the missing tensor uninitialised instead, so
        # the refill is skipped. Its own loader, forced, reads it from the verifier our export names.
        model._load_verifier_weights(overwrite_embed_tokens=True)
    assert torch.equal(model.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(model.lm_head.weight, head.lm_head.weight)
    assert model.config.eagle_aux_hidden_state_layer_ids == LAYERS  # resolved against the verifier's depth
    assert torch.equal(model.d2t + torch.arange(len(USED)), USED) and torch.equal(model.t2d.nonzero()[:, 0], USED)

    ids, hidden = _pairs(target, 11)
    with torch.no_grad():
        ours = head.unroll(ids, hidden, 3)
    _assert_ttt_equal(_speculators_ttt_logits(model, ids, hidden, 3), ours, ids.shape[1])


def test_eagle3_export_runs_speculators_default_flex_attention(verifier, tmp_path):
    """speculators' default attention (flex attention with block masks of 128 positions; unfused on CPU)."""
    target = verifier["target"]
    head = _head(target)
    folder = export_eagle3(head, tmp_path, format="speculators")
    model = _load_speculators(Eagle3DraftModel, Eagle3SpeculatorConfig, folder, attention=None)
    assert model._attn_impl == "simple_flex_attention"
    ids, hidden = _pairs(target, 128)  # its TTT mask extension assumes whole 128-position blocks
    with torch.no_grad():
        ours = head.unroll(ids, hidden, 2)
    _assert_ttt_equal(_speculators_ttt_logits(model, ids, hidden, 2), ours, ids.shape[1])


@TIED
def test_eagle3_saved_by_speculators_imports_with_its_logits(verifiers, tied, tmp_path):
    verifier = verifiers[tied]
    target, folder = verifier["target"], verifier["folder"]
    layer = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                        eos_token_id=3, bos_token_id=None)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=len(USED), eagle_aux_hidden_state_layer_ids=LAYERS,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(folder))))
    model = Eagle3DraftModel(config)
    t2d = torch.zeros(64, dtype=torch.bool).index_fill(0, USED, True)
    model.load_vocab_mappings(t2d, USED - torch.arange(len(USED)))
    model.load_verifier_weights()  # the embedding and the head rows of the draft vocabulary, from the verifier
    _randomize(model).eval()
    model.save_pretrained(tmp_path / "saved")

    ours = load_drafter(tmp_path / "saved", target=target).eval()
    assert isinstance(ours, Eagle3DrafterForCausalLM)
    assert ours.config.target_layer_ids == LAYERS and torch.equal(ours.draft_vocab_ids, USED)
    ids, hidden = _pairs(target, 11, seed=1)
    with torch.no_grad():
        mine = ours.unroll(ids, hidden, 3)
    _assert_ttt_equal(_speculators_ttt_logits(model, ids, hidden, 3), mine, ids.shape[1])


# ---------------------------------------------------------------------------------------------------------------
# DFlash, speculators layout
# ---------------------------------------------------------------------------------------------------------------
def _block_logits(drafter, target, sequence, features, anchors):
    with torch.no_grad():
        hidden = anchored_block_hidden(drafter, target.get_input_embeddings(), features, sequence[:, anchors],
                                       anchors[None])
        return target.get_output_embeddings()(hidden)[0]  # (anchors, block, vocab)


def _speculators_block_logits(model, sequence, features, final_hidden):
    """speculators' anchored-block forward with every valid anchor (``max_anchors`` = all of them, so its random
    anchor choice takes them all, in order): logits ``(anchors, block, vocab)``."""
    length = sequence.shape[1]
    anchors = length - model.block_size  # select_anchors excludes the last block_size positions
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(features, sequence, torch.ones(1, length), final_hidden,
                                                torch.zeros(1, length, dtype=torch.long), max_anchors=anchors)
    return logits.view(anchors, model.block_size, -1), torch.arange(anchors)


def _dflash_inputs(target, layers, length: int = 14, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    sequence = torch.randint(8, 60, (1, length), generator=g)
    with torch.no_grad():
        out = target(sequence, output_hidden_states=True)
    features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    return sequence, features, out.hidden_states[-1]


@TIED
def test_dflash_export_loads_in_speculators_with_our_logits(verifiers, tied, tmp_path):
    verifier = verifiers[tied]
    target = verifier["target"]
    drafter = _perturb_norms(dflash_from_target(target, mask_token_id=MASK_ID, block_size=BLOCK,
                                                num_hidden_layers=2)).eval()
    folder = export_dflash(drafter, tmp_path, format="speculators", target=target)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["speculators_config"]["verifier"]["name_or_path"] == str(verifier["folder"].resolve())

    model = _load_speculators(DFlashDraftModel, DFlashSpeculatorConfig, folder)
    _assert_same_weights(model, folder)  # embedding and head: reloaded from the verifier, equal to the stored ones
    assert model.target_layer_ids == feature_layers(drafter)
    sequence, features, final = _dflash_inputs(target, feature_layers(drafter))
    theirs, anchors = _speculators_block_logits(model, sequence, features, final)
    assert torch.isfinite(theirs).all()
    torch.testing.assert_close(theirs, _block_logits(drafter, target, sequence, features, anchors),
                               atol=1e-5, rtol=1e-5)


def _speculators_dflash(folder, draft_vocab=64):
    layer = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6,
                        pad_token_id=0, eos_token_id=3, bos_token_id=None)
    layer._attn_implementation = "eager"
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab, block_size=BLOCK,
        aux_hidden_state_layer_ids=LAYERS, mask_token_id=MASK_ID, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(folder))))
    return DFlashDraftModel(config)


@TIED
def test_dflash_saved_by_speculators_imports_with_its_logits(verifiers, tied, tmp_path):
    verifier = verifiers[tied]
    target = verifier["target"]
    model = _speculators_dflash(verifier["folder"])
    model.load_verifier_weights()
    _randomize(model).eval()
    model.save_pretrained(tmp_path / "saved")

    ours = load_drafter(tmp_path / "saved", target=target).eval()
    assert ours.config.target_layer_ids == [i - 1 for i in LAYERS] and ours.config.mask_token_id == MASK_ID
    sequence, features, final = _dflash_inputs(target, LAYERS, seed=1)
    theirs, anchors = _speculators_block_logits(model, sequence, features, final)
    torch.testing.assert_close(theirs, _block_logits(ours, target, sequence, features, anchors), atol=1e-5, rtol=1e-5)


def test_reduced_vocabulary_dflash_is_refused(verifier, tmp_path):
    """speculators' DFlash may draft over a reduced vocabulary with its own head; transformers' class cannot."""
    model = _speculators_dflash(verifier["folder"], draft_vocab=len(USED))
    t2d = torch.zeros(64, dtype=torch.bool).index_fill(0, USED, True)
    model.load_vocab_mappings(t2d, USED - torch.arange(len(USED)))
    model.load_verifier_weights()
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        load_drafter(tmp_path / "saved", target=verifier["target"])


# ---------------------------------------------------------------------------------------------------------------
# config.json: speculators' validation, and the fields vLLM reads
# ---------------------------------------------------------------------------------------------------------------
def _vllm_reads(raw: dict) -> dict:
    """What vLLM takes from a speculators config.json (``vllm/transformers_utils/configs/speculators``:
    ``SpeculatorsConfig.validate_speculators_config`` / ``build_vllm_speculative_config`` and the ``update_eagle3`` /
    ``update_dflash`` adapters, read from its source; vLLM itself cannot be installed here)."""
    spec = raw["speculators_config"]
    first = spec["proposal_methods"][0]
    out = {"method": raw["speculators_model_type"], "num_speculative_tokens": first["speculative_tokens"],
           "verifier": spec["verifier"]["name_or_path"], "layer": raw["transformer_layer_config"],
           "draft_vocab_size": raw.get("draft_vocab_size"), "target_hidden_size": raw.get("target_hidden_size")}
    if out["method"] == "eagle3":
        out.update(norm_before_residual=raw.get("norm_before_residual", True),  # vLLM's default is True
                   norm_before_fc=raw.get("norm_before_fc", False),
                   eagle_aux_hidden_state_layer_ids=raw.get("eagle_aux_hidden_state_layer_ids"))
    else:
        out.update(eagle_aux_hidden_state_layer_ids=raw["aux_hidden_state_layer_ids"],
                   dflash_config={"mask_token_id": raw["mask_token_id"],
                                  "target_layer_ids": [i - 1 for i in raw["aux_hidden_state_layer_ids"]]})
    return out


@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_speculators_validates_our_config_and_vllm_reads_our_values(verifier, family, tmp_path):
    target = verifier["target"]
    if family == "eagle3":
        drafter = _head(target)
        drafter.generation_config.ppow_window_policy = {"max_window": 5}
        folder = export_eagle3(drafter, tmp_path, format="speculators", target=target)
        config_class, private, tokens = Eagle3SpeculatorConfig, "ppow_trl", 5
    else:
        drafter = dflash_from_target(target, mask_token_id=MASK_ID, block_size=BLOCK, num_hidden_layers=2)
        folder = export_dflash(drafter, tmp_path, format="speculators", target=target)
        config_class, private, tokens = DFlashSpeculatorConfig, "ppow_target", BLOCK - 1
    raw = json.loads((folder / "config.json").read_text())

    # speculators' pydantic classes: the registry picks the class from speculators_model_type, the nested configs
    # validate, and no key of ours is unknown to speculators (its config allows extra keys, so a misspelt field
    # would otherwise pass silently): what is not a field is PretrainedConfig's or our private record.
    parsed = SpeculatorModelConfig.from_dict(raw)
    assert type(parsed) is config_class
    spec = SpeculatorsConfig.model_validate(raw["speculators_config"])
    assert isinstance(spec.proposal_methods[0], GreedyTokenProposalConfig)
    assert spec.proposal_methods[0].speculative_tokens == tokens
    assert spec.verifier == VerifierConfig.from_pretrained(str(verifier["folder"].resolve()))  # name + architectures
    pretrained_keys = set(PretrainedConfig().to_dict()) | {"torch_dtype"}
    assert set(raw) - set(config_class.model_fields) - pretrained_keys == {private}
    layer = parsed.transformer_layer_config
    assert type(layer) is type(AutoConfig.for_model(raw["transformer_layer_config"]["model_type"]))
    text = target.config
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "rms_norm_eps", "max_position_embeddings"):
        assert getattr(layer, key) == getattr(text, key), key
    assert layer.rope_parameters["rope_theta"] == text.rope_parameters["rope_theta"]

    vllm = _vllm_reads(raw)
    assert vllm["method"] == family and vllm["num_speculative_tokens"] == tokens
    assert AutoConfig.from_pretrained(vllm["verifier"]).num_hidden_layers == 6  # `vllm serve <folder>` serves it
    assert vllm["target_hidden_size"] == text.hidden_size
    if family == "eagle3":
        assert vllm["draft_vocab_size"] == len(USED) and vllm["eagle_aux_hidden_state_layer_ids"] == LAYERS
        assert vllm["norm_before_residual"] is False and vllm["norm_before_fc"] is False
        assert vllm["layer"]["num_hidden_layers"] == 1 and vllm["layer"]["vocab_size"] == 64
    else:
        assert vllm["draft_vocab_size"] == 64 and vllm["layer"]["num_hidden_layers"] == 2
        assert vllm["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": drafter.config.target_layer_ids}
        assert vllm["eagle_aux_hidden_state_layer_ids"] == feature_layers(drafter)
        assert vllm["layer"]["layer_types"] == ["full_attention"] * 2


# ---------------------------------------------------------------------------------------------------------------
# Which verifier the export names
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["eagle3", "dflash"])
def test_export_names_a_verifier_speculators_can_resolve(verifier, family, tmp_path, monkeypatch):
    import ppow_trl.models
    from ppow_trl.models import OFFLINE_TARGET

    target, folder = verifier["target"], verifier["folder"]
    if family == "eagle3":
        def build(name):
            return Eagle3DrafterForCausalLM.from_target(target, target_layer_ids=LAYERS, target_name_or_path=name)
    else:
        def build(name):
            return dflash_from_target(target, mask_token_id=MASK_ID, block_size=BLOCK, target_name_or_path=name)

    def named(drafter, sub, target, **kwargs):
        get_family(family).export(drafter, tmp_path / sub, format="speculators", target=target, **kwargs)
        raw = json.loads((tmp_path / sub / "config.json").read_text())
        return raw["speculators_config"]["verifier"]["name_or_path"]

    # a target built in memory records no path (the DFlash export needs one all the same: it stores its head)
    anonymous = AutoModelForCausalLM.from_config(copy.deepcopy(target.config))
    anonymous.config._name_or_path = ""
    # ppow_trl's offline alias names no model; the export writes the folder it stands for
    monkeypatch.setattr(ppow_trl.models, "smollm2_path", lambda: folder)
    alias = build(OFFLINE_TARGET)
    assert named(alias, "alias", anonymous) == str(folder.resolve())
    assert named(build("elsewhere/model"), "target", target) == str(folder.resolve())  # where the target came from
    assert named(alias, "explicit", target, verifier_name_or_path="org/model") == "org/model"  # the keyword wins
    assert named(build("org/recorded"), "hub", anonymous) == "org/recorded"  # a Hub id is kept
    with pytest.warns(UserWarning, match="neither a local folder"):
        named(build(str(tmp_path / "gone")), "gone", anonymous)


# ---------------------------------------------------------------------------------------------------------------
# SpecForge
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def specforge():
    module = pytest.importorskip(
        "specforge.modeling.draft.llama3_eagle",
        reason="SpecForge is not installed: run `make interop` (pip install --no-deps specforge==0.2.0)")
    import specforge.utils

    # Its rotary embedding's forward is decorated with torch.compile: run it eagerly (no C++ build on the CPU).
    # torch.compiler.set_stance is public and needs no attribute of the lazily imported torch._dynamo (patching
    # torch._dynamo.config raised AttributeError when no earlier test had imported it).
    with torch.compiler.set_stance("force_eager"):
        yield module.LlamaForCausalLMEagle3, specforge.utils.padding


def _specforge_ttt_logits(model, padding, ids, hidden, steps: int):
    """SpecForge's training-time test as its ``OnlineEagle3Model`` runs it (sdpa backend): fc, then per step the
    embedding of the left-shifted ids, ``backbone`` with the step cache, ``compute_logits``."""
    batch, length = ids.shape
    with torch.no_grad():
        state = model.project_hidden_states(hidden)
        everything = torch.ones(batch, length, dtype=torch.bool)
        mask = model.prepare_decoder_attention_mask(everything, state, batch, length, 0)
        positions = torch.arange(length)[None]
        cache, out = [[], []], []
        for _ in range(steps):
            state = model.backbone(model.embed_input_ids(ids).to(state.dtype), state, cache, mask, positions)
            out.append(model.compute_logits(state))
            ids = padding(ids, left=False)
    return out


def test_eagle3_export_loads_in_specforge_with_our_logits(verifier, specforge, tmp_path):
    """SpecForge's class built from our config.json, our weights loaded strictly (every key, no extra). Not through
    its ``from_pretrained``: with transformers 5.24 (SpecForge 0.2.0 pins 5.8.1) that leaves its non-persistent
    rotary cache uninitialised (NaN), whatever the checkpoint."""
    model_class, padding = specforge
    target = verifier["target"]
    head = _head(target)
    folder = export_eagle3(head, tmp_path, format="specforge")
    model = model_class(LlamaConfig.from_pretrained(str(folder)))
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    model.eval()
    assert model.draft_vocab_size == len(USED) and model.norm_output is True
    assert torch.equal(model.d2t + torch.arange(len(USED)), USED) and torch.equal(model.t2d.nonzero()[:, 0], USED)
    ids, hidden = _pairs(target, 11)
    with torch.no_grad():
        ours = head.unroll(ids, hidden, 3)
    _assert_ttt_equal(_specforge_ttt_logits(model, padding, ids, hidden, 3), ours, ids.shape[1])


def test_eagle3_saved_by_specforge_imports_with_its_logits(verifier, specforge, tmp_path):
    model_class, padding = specforge
    target = verifier["target"]
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         eos_token_id=3, bos_token_id=None, tie_word_embeddings=False)
    config.draft_vocab_size = len(USED)
    # SpecForge's convention: the decoder layer whose output is read (ours - 1)
    config.eagle_config = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in LAYERS], "use_aux_hidden_state": True}
    model = _randomize(model_class(config), skip=("embed_tokens",))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        model.d2t.copy_(USED - torch.arange(len(USED)))
        model.t2d.copy_(torch.zeros(64, dtype=torch.bool).index_fill(0, USED, True))
    model.eval().save_pretrained(tmp_path / "saved")

    ours = import_eagle3(tmp_path / "saved", target=target).eval()
    assert ours.config.target_layer_ids == LAYERS and torch.equal(ours.draft_vocab_ids, USED)
    ids, hidden = _pairs(target, 11, seed=1)
    with torch.no_grad():
        mine = ours.unroll(ids, hidden, 3)
    _assert_ttt_equal(_specforge_ttt_logits(model, padding, ids, hidden, 3), mine, ids.shape[1])


def test_dflash_zlab_export_loads_in_specforge_with_our_block_states(verifier, tmp_path):
    """SpecForge's ``DFlashDraftModel`` (z-lab's architecture; vLLM ``method: dflash`` and SGLang ``DFLASH`` read the
    same names) built from our z-lab ``config.json``, our weights loaded strictly: every block's output states equal
    ours (before the target's head)."""
    module = pytest.importorskip(
        "specforge.modeling.draft.dflash",
        reason="SpecForge is not installed: run `make interop` (pip install --no-deps specforge==0.2.0)")
    target = verifier["target"]
    drafter = _perturb_norms(dflash_from_target(target, mask_token_id=MASK_ID, block_size=BLOCK,
                                                num_hidden_layers=2)).eval()
    folder = export_dflash(drafter, tmp_path, format="zlab")
    config = Qwen3Config.from_pretrained(str(folder))
    config._attn_implementation = "eager"  # no mask: the block and its context attend both ways, as in DFlash
    model = module.DFlashDraftModel(config)
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    model.eval()
    assert model.target_layer_ids == drafter.config.target_layer_ids and model.block_size == BLOCK
    assert model.mask_token_id == MASK_ID and model.layer_types == ("full_attention",) * 2
    sequence, features, _ = _dflash_inputs(target, feature_layers(drafter))
    embed = target.get_input_embeddings()
    with torch.no_grad():
        for anchor in range(1, sequence.shape[1] - BLOCK):
            block = torch.full((1, BLOCK), MASK_ID)
            block[0, 0] = sequence[0, anchor]
            theirs = model(position_ids=torch.arange(anchor + BLOCK)[None], noise_embedding=embed(block),
                           target_hidden=features[:, :anchor])  # the context: every position before the anchor
            ours = anchored_block_hidden(drafter, embed, features, sequence[:, [anchor]], torch.tensor([[anchor]]))
            torch.testing.assert_close(theirs[0], ours[0, 0], atol=1e-5, rtol=1e-5)
