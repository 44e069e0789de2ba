"""Other runtimes a trained drafter serves in: llama.cpp's GGUF layout for standalone Llama drafters
(``gguf_export``), our window rule as a llama-cpp-python draft model (``llama_cpp_draft``: ``LlamaCppDrafter``,
and the pairing check llama.cpp runs on a target and a drafter), and the CMake options llama.cpp is built with on
this CPU (``llama_cpp_build``). llama-cpp-python is optional and loads a native library: ``llama_cpp_draft`` (which
imports it) is imported on first use of one of its names here, not with the package.
"""

from .gguf_export import export_gguf, find_gguf, gguf_files, load_gguf_drafter
from .llama_cpp_build import cmake_args, has_amx

_LLAMA_CPP_DRAFT = ("LlamaCppDrafter", "pairing_problems", "quantize_gguf", "read_window_policy")


def __getattr__(name: str):
    if name in _LLAMA_CPP_DRAFT:
        from . import llama_cpp_draft

        return getattr(llama_cpp_draft, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LlamaCppDrafter",
    "cmake_args",
    "export_gguf",
    "find_gguf",
    "gguf_files",
    "has_amx",
    "load_gguf_drafter",
    "pairing_problems",
    "quantize_gguf",
    "read_window_policy",
]
