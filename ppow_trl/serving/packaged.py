"""The compiled runtime's graphs as AOTInductor packages on disk: a warm start loads them in seconds.

Why: ``torch.compile`` traces, functionalizes and freezes every graph again in each new process before its on-disk
cache can answer (freezing bypasses AOTAutograd's cache): SmolLM2 fp32, 5 row counts, a filled cache, AMD EPYC:
274 s, every time a job starts. An AOTInductor package (``torch._inductor.aoti_compile_and_package``) is the finished
graph: its kernels, the C++ code that calls them, and the frozen, pre-packed weights. Loading SmolLM2's 5 packages
took 5-10 s on the same machine.

How:

- The forward is exported (``torch.export``, non-strict) as ``CacheStep(input_ids, position_ids, *state)``, where
  ``state`` is the static cache's tensors (``cache_state``: every layer's keys, values and filled length), inputs
  that the graph updates in place. A package holds no cache: it serves the runtime's ``StaticCache``, which the
  eager prefill and ``crop_cache`` share.
- A package embeds the weights, so its name is keyed by them: ``weights_digest`` hashes every parameter and buffer
  (name, dtype, shape, bytes), the config, transformers' version and the source of this module and of the attention
  it traces. A trained drafter or a converted target gets packages of its own, and a package can never serve weights
  or code other than the ones it was built from. The runtime adds the settings' key (``compile_cache_dir``'s name:
  torch's version, the CPU's instruction sets, the thread count, the inductor settings).
- Only full static caches (``StaticLayer``): a sliding-window layer keeps its length in a Python int that a traced
  graph would freeze; ``build_package`` refuses it, and the runtime compiles with torch.compile instead.
- A package is written under a temporary name and renamed when complete: an interrupted build leaves nothing that a
  later process could load.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import uuid
from pathlib import Path

import torch

BUILT = 0
"""Packages built (compiled, not loaded) in this process: a served loop must not add to it."""


def cache_state(cache) -> list[torch.Tensor]:
    """A static cache's tensors in the order ``CacheStep`` takes them: keys, values, filled length, per layer."""
    return [tensor for layer in cache.layers for tensor in (layer.keys, layer.values, layer.cumulative_length)]


class CacheStep(torch.nn.Module):
    """``model``'s forward over ``cache`` with the cache's tensors as arguments: ``(input_ids, position_ids, *state)
    -> logits``. Exported, the graph takes the cache it updates as inputs instead of holding one of its own."""

    def __init__(self, model, cache):
        super().__init__()
        self.model = model
        self.cache = cache

    def forward(self, input_ids, position_ids, *state):
        layers = self.cache.layers
        saved = [(layer.keys, layer.values, layer.cumulative_length) for layer in layers]
        for i, layer in enumerate(layers):  # the traced inputs stand in for the cache's own tensors while tracing
            layer.keys, layer.values, layer.cumulative_length = state[3 * i: 3 * i + 3]
        try:
            return self.model(input_ids=input_ids, position_ids=position_ids, cache=self.cache, use_cache=True).logits
        finally:
            for layer, tensors in zip(layers, saved):
                layer.keys, layer.values, layer.cumulative_length = tensors


def weights_digest(model) -> str:
    """A hash of what a package embeds: every parameter and buffer (name, dtype, shape, bytes) and the config.
    About a second for SmolLM2's 0.5 GB."""
    import transformers

    digest = hashlib.blake2b(digest_size=12)
    # the code a graph is traced from: transformers' model code, and this runtime's cache step and attention
    digest.update(transformers.__version__.encode())
    for source in (Path(__file__), Path(__file__).with_name("attention.py")):
        digest.update(source.read_bytes())
    config = getattr(model, "config", None)
    digest.update((config.to_json_string() if hasattr(config, "to_json_string") else type(model).__name__).encode())
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def package_path(folder: Path, digest: str, rows: int, max_rows: int, max_cache_len: int) -> Path:
    """``folder/packages/<weights digest>/rows<q>-of<K+1>-cache<len>.pt2``: one graph of one model."""
    return Path(folder) / "packages" / digest / f"rows{rows}-of{max_rows}-cache{max_cache_len}.pt2"


def build_package(model, cache, rows: int, path: Path, *, compile_context, attention=None) -> Path:
    """Export ``model``'s forward for ``rows`` rows over ``cache`` and compile it into an AOTInductor package at
    ``path`` (under ``compile_context``: the inductor settings; ``attention``: the attention the graph is traced
    with). The cache's contents are not changed: export traces with fake tensors."""
    global BUILT
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {"StaticLayer"}:
        # a sliding-window layer keeps its length in a Python int, which a traced graph would freeze
        raise ValueError(f"Packages serve full static caches only (StaticLayer); this cache has {sorted(kinds)}.")
    device = cache.layers[0].keys.device
    ids = torch.zeros((1, rows), dtype=torch.long, device=device)
    positions = torch.arange(rows, device=device).unsqueeze(0)
    with torch.no_grad(), (attention or contextlib.nullcontext()):
        exported = torch.export.export(CacheStep(model, cache).eval(), (ids, positions, *cache_state(cache)),
                                       strict=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.partial.pt2")  # unique across processes and hosts
    try:
        with compile_context:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
        os.replace(partial, path)
        BUILT += 1
    finally:
        partial.unlink(missing_ok=True)
    return path


def load_package(path: Path):
    """The compiled graph in ``path``: ``runner(input_ids, position_ids, *cache_state(cache)) -> logits``."""
    runner = torch._inductor.aoti_load_package(str(path))

    def run(*args):
        out = runner(*args)
        return out[0] if isinstance(out, (list, tuple)) else out

    return run
