"""GGUF export of standalone drafters, for llama.cpp on CPUs (``llama-speculative-simple`` / ``llama-server``
``-md drafter.gguf --spec-type draft-simple``; ``ppow_trl.interop.llama_cpp_draft`` from Python).

``export_gguf(drafter, "drafter.gguf", tokenizer)`` writes a Llama-architecture causal LM (a truncated target, a small
LM of the target's tokenizer) as one ``.gguf`` file the way llama.cpp's ``convert_hf_to_gguf.py`` writes Llama models:

- **tensors** under llama.cpp's names (``token_embd``, ``blk.N.attn_q`` / ``attn_k`` / ``attn_v`` / ``attn_output``,
  ``ffn_gate`` / ``ffn_up`` / ``ffn_down``, ``attn_norm``, ``ffn_norm``, ``output_norm``, ``output``), taken from
  ``gguf``'s own ``TensorNameMap``. The rows of ``attn_q`` and ``attn_k`` are permuted into llama.cpp's rotary layout
  (``LlamaModel.permute`` of the converter: each head's two rotary halves interleaved); transformers' GGUF loader
  undoes it (``LlamaTensorProcessor._reverse_permute_weights``). Tied embeddings: no ``output`` tensor, as the
  converter writes them, and as transformers reads them back (``tie_word_embeddings`` = no ``output.weight``).
- **hyperparameters** ``llama.block_count``, ``context_length``, ``embedding_length``, ``feed_forward_length``,
  ``attention.head_count`` / ``head_count_kv`` / ``key_length`` / ``value_length`` / ``layer_norm_rms_epsilon``,
  ``rope.freq_base``, ``rope.dimension_count``, ``vocab_size``, and ``general.file_type``.
- **types**: ``dtype="f32"`` writes every tensor in float32 (the reloaded model computes the drafter's logits to fp32
  rounding); ``"f16"`` writes matrices in float16 and the norms in float32 (the converter's ``--outtype f16``). For
  smaller files, run llama.cpp's ``llama-quantize`` on the f32/f16 file.
- **vocabulary** (``tokenizer.ggml.*``), which llama.cpp needs to pair a draft model with its target (same vocabulary
  type, same BOS/EOS, same token texts). ``tokenizer`` is either

  * the target's **GGUF file** (a path): its ``tokenizer.*`` metadata is copied verbatim, so the drafter's
    vocabulary is byte-for-byte the target's. The right choice when the target itself is a GGUF, e.g. the offline
    SmolLM2 (``ppow_trl.offline.smollm2_gguf_path()``); or
  * a **Hugging Face tokenizer** with a byte-level BPE model (GPT-2 style: SmolLM2, Llama 3, Qwen): written as
    ``tokenizer.ggml.model = "gpt2"`` with the converter's ``get_vocab_base`` rules (token texts, NORMAL / CONTROL /
    USER_DEFINED / UNUSED types, ``[PAD{i}]`` for rows the tokenizer lacks), ``gguf.SpecialVocab`` for the merges,
    special token ids, ``add_bos`` / ``add_eos`` and chat template, and ``tokenizer.ggml.pre`` from the converter's
    hash of a reference text (a few known values; ``"default"`` otherwise, with a warning: llama.cpp's speculative
    decoding hands the draft the target's token ids, so the draft's pre-tokenizer is not used there). SentencePiece
    and word-level tokenizers are refused (pass the target's GGUF file, or convert with llama.cpp); or
  * ``None``: no vocabulary (``tokenizer.ggml.model = "no_vocab"``), with a warning. transformers loads such a file;
    llama.cpp loads it but will not pair it with a target. Only for tests and in-memory models.

Refused, each with a message saying what to do: a PEFT model (merge it first), an architecture other than Llama, a
rotary scaling (``rope_type`` other than ``default``: transformers' GGUF loader would not read it back), attention or
MLP biases. A **reduced-vocabulary** drafter (``PPOWDrafterForCausalLM``, ``draft_vocab_ids``) cannot be written as
it is: it puts ``-inf`` on every id outside its draft vocabulary, and a GGUF Llama head has no bias to carry that.
It is refused unless ``expand_reduced_head=True``, which writes a full-vocabulary head whose rows outside the draft
vocabulary are zeros: those ids then get logit 0 instead of ``-inf``, so the exported drafter proposes the same
greedy token only where its best draft logit is above 0 (and a sampled proposal puts some mass outside the draft
vocabulary). Speculative decoding stays lossless either way (the target verifies every proposal); only the drafter's
acceptance can change. ``expanded_head_agreement`` measures where it changes on given contexts.

Reading back: ``load_gguf_drafter(path)`` (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, the
quantizer marker dropped so that it trains and saves like any causal LM). The standalone family exports this layout
(``export_format: gguf``) and ``load_drafter`` / ``detect_family`` recognise a folder or Hub repo holding one
``.gguf`` file and no ``config.json``.
"""

from __future__ import annotations

import logging
import tempfile
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch

from ..utils import is_peft_model, require_package, unwrap_model

logger = logging.getLogger(__name__)

GGUF_DTYPES = ("f32", "f16")
GGUF_FILENAME = "drafter-{dtype}.gguf"
"""The file name ``export_gguf`` writes when given a folder."""

NO_VOCAB = "no_vocab"
"""``tokenizer.ggml.model`` of a file written without a tokenizer (llama.cpp's name for a model without vocabulary)."""

# llama.cpp's convert_hf_to_gguf.py (get_vocab_base_pre): the BPE pre-tokenizer is identified by the sha256 of the
# token ids of this text; llama.cpp picks its pre-tokenizer regex from the name. A few of its entries, for the
# tokenizers drafters here use; any other hash writes "default".
_CHECK_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
    "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо "
    "на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you sure? 'M not sure I'll "
    "make it, 'D you like some tea? We'Ve a'lL"
)
_KNOWN_PRE_TOKENIZERS = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # Meta-Llama-3
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # SmolLM / SmolLM2
}

_PERMUTED = ("self_attn.q_proj", "self_attn.k_proj")


# ---------------------------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------------------------


def export_gguf(drafter, folder_or_file, tokenizer=None, *, dtype: str = "f32", expand_reduced_head: bool = False,
                name: str | None = None) -> Path:
    """Write a standalone Llama drafter as a llama.cpp GGUF file (module docstring); returns the file's path.

    Args:
        drafter: a Llama causal LM (``LlamaForCausalLM``, a truncated target, or a ``PPOWDrafterForCausalLM`` with
            ``expand_reduced_head=True``). A PEFT model is refused: ``merge_and_unload()`` first.
        folder_or_file: a path ending in ``.gguf``, or a folder (created) that gets ``drafter-{dtype}.gguf``.
        tokenizer: the target's GGUF file (its vocabulary is copied), a byte-level BPE Hugging Face tokenizer, or
            ``None`` (no vocabulary, with a warning; llama.cpp then cannot pair the drafter with a target).
        dtype: ``"f32"`` (exact) or ``"f16"`` (matrices in float16, norms in float32).
        expand_reduced_head: write a reduced-vocabulary head as a full head with zero rows outside the draft
            vocabulary (module docstring: greedy proposals unchanged only where the best draft logit is > 0).
        name: ``general.name`` (default: the drafter's ``name_or_path`` or ``"ppow-drafter"``).
    """
    require_package("gguf")
    import gguf

    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype must be one of {GGUF_DTYPES}, got {dtype!r}.")
    if is_peft_model(drafter):
        raise ValueError("This drafter is a PEFT model: GGUF holds one set of weights. Merge the adapter first "
                         "(`drafter = peft_model.merge_and_unload()`), then export the merged drafter.")
    model = unwrap_model(drafter)
    config, body, head = _llama_parts(model, expand_reduced_head)
    _check_llama_config(config)
    path = Path(folder_or_file)
    if path.suffix != ".gguf":
        path = path / GGUF_FILENAME.format(dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)

    vocab_rows = body.embed_tokens.weight.shape[0]
    if head is not None and head.shape[0] != vocab_rows:
        raise ValueError(f"The head has {head.shape[0]} rows but the embedding {vocab_rows}: llama.cpp needs one "
                         "vocabulary for both.")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)) and not _byte_level_bpe(tokenizer):
        raise ValueError(
            f"export_gguf writes byte-level BPE vocabularies (GPT-2 style: SmolLM2, Llama 3, Qwen); "
            f"{type(tokenizer).__name__} is not one. Pass the target's GGUF file as tokenizer= (its vocabulary is "
            "copied), or convert a save_pretrained folder with llama.cpp's convert_hf_to_gguf.py."
        )
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    try:
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_name(name or Path(str(getattr(model, "name_or_path", "") or "ppow-drafter")).name or "ppow-drafter")
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_freq_base(float(_rope_theta(config)))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        writer.add_vocab_size(vocab_rows)
        writer.add_rope_dimension_count(head_dim)
        _add_vocabulary(writer, tokenizer, vocab_rows)
        for tensor_name, array in _gguf_tensors(config, body, head, dtype):
            writer.add_tensor(tensor_name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except BaseException:
        writer.close()
        path.unlink(missing_ok=True)  # never leave a partial file behind
        raise
    writer.close()
    return path


def _llama_parts(model, expand_reduced_head: bool):
    """``(text config, decoder body, head weight or None when tied)`` of a Llama causal LM or reduced drafter."""
    ids = getattr(model, "draft_vocab_ids", None)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    body = model.get_decoder()
    head = model.get_output_embeddings().weight.detach()
    if isinstance(ids, torch.Tensor):  # a reduced-vocabulary head (PPOWDrafterForCausalLM)
        full = int(getattr(model.config, "full_vocab_size", 0) or body.embed_tokens.weight.shape[0])
        if not expand_reduced_head:
            raise ValueError(
                f"This drafter has a reduced-vocabulary head ({head.shape[0]} of {full} tokens): it gives -inf to every "
                "other token, which a GGUF Llama head (no bias) cannot express. Either export a full-vocabulary "
                "drafter, or pass expand_reduced_head=True to write the head with zero rows outside the draft "
                "vocabulary: those tokens then get logit 0 instead of -inf, so the exported drafter proposes the same "
                "greedy tokens only where its best draft logit is above 0 (ppow_trl.interop.gguf_export."
                "expanded_head_agreement measures it). Speculative decoding stays lossless either way."
            )
        expanded = head.new_zeros(full, head.shape[1])
        expanded[ids.to(head.device)] = head
        return config, body, expanded
    tied = bool(getattr(config, "tie_word_embeddings", False)) and head.data_ptr() == body.embed_tokens.weight.data_ptr()
    return config, body, None if tied else head


def _check_llama_config(config) -> None:
    what_to_do = ("Export the drafter with save_pretrained and convert that folder with llama.cpp's "
                  "convert_hf_to_gguf.py, which knows more architectures.")
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"export_gguf writes Llama-architecture drafters; this one is {config.model_type!r}. "
                         + what_to_do)
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("This Llama drafter has attention or MLP biases, which export_gguf does not write. " + what_to_do)
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"Llama in llama.cpp uses SiLU; this drafter uses {config.hidden_act!r}.")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type not in (None, "default"):
        raise ValueError(
            f"This drafter uses rotary scaling {rope_type!r}; export_gguf writes plain RoPE only (transformers' GGUF "
            "loader would not read the scaling back, so the export could not be checked). " + what_to_do
        )


def _rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and "rope_theta" in rope:
        return rope["rope_theta"]
    return getattr(config, "rope_theta", 10000.0)


def llama_permute(weight: torch.Tensor, n_head: int, n_head_kv: int | None = None) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py): HF's rotary halves -> interleaved pairs, per head.
    ``n_head_kv`` (when it differs) is the number of heads of a K projection."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _gguf_tensors(config, body, head, dtype: str):
    """``(gguf name, numpy array)`` pairs in llama.cpp's layout."""
    import gguf

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tensors = [(f"model.{key}", value) for key, value in body.state_dict().items()
               if not key.endswith("rotary_emb.inv_freq")]
    if head is not None:
        tensors.append(("lm_head.weight", head))
    for hf_name, value in tensors:
        base, _, suffix = hf_name.rpartition(".")
        gguf_name = name_map.get_name(base)
        if gguf_name is None:
            raise ValueError(f"No llama.cpp tensor name for {hf_name}: export_gguf writes plain Llama decoders.")
        value = value.detach().to(device="cpu", dtype=torch.float32)
        if base.endswith(_PERMUTED[0]):
            value = llama_permute(value, config.num_attention_heads, config.num_attention_heads)
        elif base.endswith(_PERMUTED[1]):
            value = llama_permute(value, config.num_attention_heads, config.num_key_value_heads)
        array = value.numpy()
        if dtype == "f16" and array.ndim > 1:  # the converter keeps 1-D tensors (norms) in float32
            array = array.astype(np.float16)
        yield f"{gguf_name}.{suffix}", np.ascontiguousarray(array)


# ---------------------------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------------------------


def _add_vocabulary(writer, tokenizer, vocab_rows: int) -> None:
    if tokenizer is None:
        logger.warning(
            "export_gguf: no tokenizer given, so the GGUF carries no vocabulary (tokenizer.ggml.model = %r). "
            "transformers loads it, but llama.cpp will not pair it with a target as a draft model: pass the "
            "target's GGUF file or its Hugging Face tokenizer.", NO_VOCAB)
        writer.add_tokenizer_model(NO_VOCAB)
        return
    if isinstance(tokenizer, (str, Path)):
        _copy_vocabulary(writer, Path(tokenizer), vocab_rows)
        return
    _write_bpe_vocabulary(writer, tokenizer, vocab_rows)


def _copy_vocabulary(writer, gguf_path: Path, vocab_rows: int) -> None:
    """Every ``tokenizer.*`` key of another GGUF file (the target's), with its stored types."""
    import gguf

    if not gguf_path.is_file() or gguf_path.suffix != ".gguf":
        raise ValueError(f"tokenizer={str(gguf_path)!r} is not a .gguf file: pass a GGUF file whose vocabulary to copy, "
                         "or a Hugging Face tokenizer.")
    reader = gguf.GGUFReader(gguf_path)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{gguf_path} has no vocabulary (tokenizer.ggml.tokens) to copy.")
    if len(tokens.data) != vocab_rows:
        raise ValueError(f"{gguf_path} has {len(tokens.data)} tokens but the drafter's embedding has {vocab_rows} rows: "
                         "llama.cpp needs them equal. Is it the target of this drafter?")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main_type = field.types[0]
        sub_type = field.types[-1] if main_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main_type, sub_type=sub_type)


def _byte_level_bpe(tokenizer) -> bool:
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    spec = json.loads(backend.to_str())
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    parts = [spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}]
    found = []
    while parts:
        part = parts.pop()
        found.append(part.get("type"))
        parts.extend(part.get("pretokenizers") or part.get("decoders") or [])
    return "ByteLevel" in found


def pre_tokenizer_name(tokenizer) -> str | None:
    """llama.cpp's ``tokenizer.ggml.pre`` for this tokenizer when its hash is one ``_KNOWN_PRE_TOKENIZERS`` lists."""
    ids = tokenizer.encode(_CHECK_TEXT)
    return _KNOWN_PRE_TOKENIZERS.get(sha256(str(ids).encode()).hexdigest())


def _write_bpe_vocabulary(writer, tokenizer, vocab_rows: int) -> None:
    """convert_hf_to_gguf.py's ``_set_vocab_gpt2`` (``get_vocab_base`` + ``gguf.SpecialVocab``) for an in-memory
    tokenizer."""
    import gguf

    vocab = tokenizer.get_vocab()
    if max(vocab.values()) >= vocab_rows:
        raise ValueError(f"The tokenizer has ids up to {max(vocab.values())} but the drafter's embedding only "
                         f"{vocab_rows} rows: is it the target's tokenizer?")
    reverse = {index: token for token, index in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for index in range(vocab_rows):
        if index not in reverse:
            tokens.append(f"[PAD{index}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[index]
        if token in added:
            if index in decoder and not decoder[index].normalized:  # llama.cpp expects pre-normalized added tokens
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if (index in decoder and decoder[index].special) or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    pre = pre_tokenizer_name(tokenizer)
    if pre is None:
        logger.warning("export_gguf: this tokenizer's pre-tokenizer is not one export_gguf knows; writing "
                       "tokenizer.ggml.pre = 'default'. llama.cpp's speculative decoding reads the target's tokens, "
                       "so the draft's pre-tokenizer is not used there; running the drafter alone in llama.cpp may "
                       "tokenize text differently.")
        pre = "default"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        special = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_rows)
    # llama.cpp pairs a draft with its target only when both add (or both omit) BOS / EOS: where the saved files do
    # not say, write what the tokenizer does.
    for kind, adds in _adds_special_tokens(tokenizer).items():
        special.add_special_token.setdefault(kind, adds)
    special.add_to_gguf(writer, quiet=True)


def _adds_special_tokens(tokenizer) -> dict[str, bool]:
    """Whether encoding a text adds the tokenizer's BOS at the start / EOS at the end."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {"bos": bos is not None and full[:1] == [bos] and plain[:1] != [bos],
            "eos": eos is not None and full[-1:] == [eos] and plain[-1:] != [eos]}


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's ``does_token_look_special``."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<｜") and token.endswith("｜>"))
            or (token.startswith("<unused") and token.endswith(">")))


# ---------------------------------------------------------------------------------------------------------------
# Reading back
# ---------------------------------------------------------------------------------------------------------------


def gguf_files(folder_or_repo, **hub_kwargs) -> list[str]:
    """The names of the ``.gguf`` files at the top of a local folder or Hub repo (a ``.gguf`` path: its own name)."""
    source = Path(str(folder_or_repo))
    if source.is_file():
        return [source.name] if source.suffix == ".gguf" else []
    if source.is_dir():
        return sorted(path.name for path in source.glob("*.gguf"))
    return sorted(name for name in _repo_files(str(folder_or_repo), **hub_kwargs)
                  if name.endswith(".gguf") and "/" not in name)


def find_gguf(folder_or_repo, **hub_kwargs) -> str | None:
    """The one ``.gguf`` file of a local folder or Hub repo (its name), ``None`` where there is none; several refused
    (pass ``gguf_file=``)."""
    names = gguf_files(folder_or_repo, **hub_kwargs)
    if len(names) > 1:
        raise ValueError(f"{folder_or_repo} holds several GGUF files ({names}): pass gguf_file= to choose one.")
    return names[0] if names else None


def _repo_files(repo_id: str, revision=None, token=None, cache_dir=None, local_files_only=False, **_) -> list[str]:
    """The files of a Hub repo: listed by the Hub, else (offline) those of the cached snapshot; empty when neither."""
    from huggingface_hub import HfApi, snapshot_download

    if not local_files_only:
        try:
            return HfApi().list_repo_files(repo_id, revision=revision, token=token)
        except Exception as error:  # noqa: BLE001 -- offline, no access, no such repo: fall back to a cached snapshot
            logger.debug("Could not list the files of %s (%s); looking for a cached snapshot.", repo_id, error)
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, token=token, cache_dir=cache_dir,
                                        local_files_only=True))
    except Exception:  # noqa: BLE001 -- nothing cached either
        return []
    return [path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()]


def load_gguf_drafter(folder_or_file, *, gguf_file: str | None = None, **from_pretrained_kwargs):
    """A drafter from a GGUF file (a ``.gguf`` path, or a folder / Hub repo holding one): transformers' GGUF loader
    (``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``), with the quantizer marker it leaves dropped so
    that the model trains and saves like any causal LM (``ppow_trl.offline`` does the same)."""
    from transformers import AutoModelForCausalLM

    from_pretrained_kwargs.pop("trust_remote_code", None)  # transformers' own class: no remote code involved
    source = Path(str(folder_or_file))
    if source.is_file():
        source, gguf_file = source.parent, source.name
    hub_kwargs = {k: from_pretrained_kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only")
                  if k in from_pretrained_kwargs}
    gguf_file = gguf_file or find_gguf(folder_or_file, **hub_kwargs)
    if gguf_file is None:
        raise FileNotFoundError(f"No .gguf file in {folder_or_file}.")
    model = AutoModelForCausalLM.from_pretrained(str(source) if source.is_dir() else str(folder_or_file),
                                                 gguf_file=gguf_file, **from_pretrained_kwargs)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    return model


def expanded_head_agreement(drafter, input_ids: torch.Tensor) -> float:
    """For a reduced-vocabulary drafter: the share of positions of ``input_ids`` ``(B, T)`` whose greedy proposal
    ``expand_reduced_head=True`` keeps (best draft logit > 0: the zero rows do not win)."""
    with torch.no_grad():
        out = unwrap_model(drafter)(input_ids=input_ids, full_vocab_logits=False)
    return float((out.draft_logits.max(-1).values > 0).float().mean())


__all__ = ["GGUF_DTYPES", "GGUF_FILENAME", "NO_VOCAB", "expanded_head_agreement", "export_gguf", "find_gguf",
           "gguf_files", "llama_permute", "load_gguf_drafter", "pre_tokenizer_name"]
