"""The resumable, sharded cache that every data builder runs through, and the fingerprints that key it.

Read top to bottom:

1. Fingerprints (`model_fingerprint`, `tokenizer_fingerprint`, `dataset_fingerprint`): what a cached result
   depends on, hashed into the cache folder's name.
2. Saving: a dataset (or a file) is written under a temporary name private to this process and then published
   under its final name (`_save_atomically`, `_write_json_atomically`, `_publish`), so an interrupted save never
   looks finished and several processes building the same cache at once never collide: the first to publish
   wins, the others discard their copy and use the published one.
3. `open_cache_folder` and `build_sharded_dataset`: work cut into fixed chunks, each finished chunk saved as
   `<cache_dir>/<kind>-<fingerprint>/shard-00000`, a restart loading the finished shards and computing only
   the missing ones.
4. `main_process_first`: under `accelerate launch` with several processes, let the main process build the
   cache while the others wait, then load it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets import Dataset, Features, concatenate_datasets, load_from_disk
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_SIZE = 64
# Bump when the content of a cached shard changes for the same settings, so old caches are not reused.
CACHE_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------------------
# Fingerprints: what a cached result depends on
# ---------------------------------------------------------------------------------------------------------


def _sha256(obj: Any, length: int = 16) -> str:
    """Short, stable hash of a JSON-serialisable object."""
    text = json.dumps(obj, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:length]


def model_fingerprint(model: torch.nn.Module) -> dict[str, str]:
    """Name, config hash and a weight probe of `model`.

    The probe hashes 16 evenly spaced values of every parameter: a model fine-tuned in place (same path,
    same config) gets another fingerprint, at the cost of a few hundred tiny reads.
    """
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if config is not None else {}
    config_dict.pop("transformers_version", None)  # the same model under another library version
    hasher = hashlib.sha256()
    for name, parameter in model.named_parameters():
        hasher.update(f"{name}{tuple(parameter.shape)}{parameter.dtype}".encode())
        if parameter.device.type != "meta":  # offloaded weights have no values to read
            flat = parameter.detach().reshape(-1)
            probe = flat[:: max(1, flat.numel() // 16)][:16]
            hasher.update(repr(probe.to("cpu", torch.float64).tolist()).encode())
    return {
        "name_or_path": str(getattr(config, "name_or_path", "") or type(model).__name__),
        "config": _sha256(config_dict),
        "weights": hasher.hexdigest()[:16],
    }


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary, special tokens and chat template: everything that changes prompt ids."""
    return _sha256(
        {
            "vocab": sorted(tokenizer.get_vocab().items()),
            "special": {name: str(value) for name, value in tokenizer.special_tokens_map.items()},
            "chat_template": tokenizer.chat_template,
            "class": type(tokenizer).__name__,
        }
    )


def dataset_fingerprint(dataset: Dataset) -> str:
    """Content hash of every row and column of `dataset` (not datasets' own `_fingerprint`, which is random
    for in-memory datasets)."""
    hasher = hashlib.sha256(repr(dataset.features).encode())
    for batch in dataset.iter(batch_size=1000):
        hasher.update(json.dumps(batch, sort_keys=True, default=str).encode("utf-8"))
    return hasher.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Saving and publishing (safe against interruption and against other processes)
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _datasets_progress_bars_disabled() -> Iterator[None]:
    """Silence datasets' own bars while saving/loading shards: ours already reports progress."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def _temporary_name(path: Path) -> Path:
    """A name next to `path` that no other process uses: `<name>.tmp-<pid>-<random hex>`.

    Same parent folder, so publishing is a rename within one file system. A process killed mid-save leaves
    its temporary behind; it is never read (only final names are) and may be deleted by hand.
    """
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def _discard(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _publish(tmp: Path, destination: Path) -> bool:
    """Rename the finished `tmp` to `destination`, unless another process published `destination` first.

    Returns True if ours was published, False if `destination` already existed: then `tmp` is discarded and
    the caller uses the published copy (every writer computes the same content from the same settings).
    A folder is renamed with `os.rename`, which never replaces a non-empty folder, so two processes
    publishing at the same moment cannot both win. A file can only lose the race between the check and
    the rename, and then replaces an equal file atomically.
    """
    if destination.exists():
        _discard(tmp)
        return False
    try:
        os.rename(tmp, destination)
    except OSError:
        if not destination.exists():
            raise
        _discard(tmp)  # another process published it between our check and our rename
        return False
    return True


def _save_atomically(dataset: Dataset, folder: Path) -> bool:
    """`save_to_disk` into a private temporary folder, then publish it as `folder` (see `_publish`).

    An interrupted save never looks finished. Returns False if another process published `folder` first
    (ours is discarded: load `folder` to use theirs).
    """
    tmp = _temporary_name(folder)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _datasets_progress_bars_disabled():
            dataset.save_to_disk(str(tmp))
    except BaseException:
        _discard(tmp)
        raise
    return _publish(tmp, folder)


def _load_quietly(folder: Path, features: Features | None = None) -> Dataset:
    """The dataset saved in ``folder``. A shard whose rows were all dropped (e.g. every prompt of a length-sorted
    chunk over ``max_prompt_length``) is saved without data files, which ``load_from_disk`` cannot read: it comes
    back as an empty dataset with ``features``."""
    state = folder / "state.json"
    if features is not None and state.exists() and not json.loads(state.read_text()).get("_data_files"):
        return _dataset_from_rows([], features)
    with _datasets_progress_bars_disabled():
        return load_from_disk(str(folder))


def _write_json_atomically(data: Any, path: Path) -> bool:
    """Write `data` as JSON to a private temporary file, then publish it as `path` (see `_publish`)."""
    tmp = _temporary_name(path)
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str), encoding="utf-8")
    return _publish(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# The resumable sharded cache (one implementation for every builder)
# ---------------------------------------------------------------------------------------------------------


def _dataset_from_rows(rows: list[dict[str, Any]], features: Features) -> Dataset:
    """A Dataset with exactly `features`, built column by column (extra keys in `rows` are ignored)."""
    return Dataset.from_dict({name: [row[name] for row in rows] for name in features}, features=features)


def _manifest(kind: str, settings: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "format": CACHE_FORMAT_VERSION, "settings": settings}


def cache_folder(cache_dir: str | Path, kind: str, settings: dict[str, Any]) -> Path:
    """Where the cache of ``kind`` built with ``settings`` lives (``open_cache_folder`` creates it)."""
    return Path(cache_dir) / f"{kind}-{_sha256(_manifest(kind, settings))}"


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.is_dir() else 0


def open_cache_folder(cache_dir: str | Path, kind: str, settings: dict[str, Any]) -> Path:
    """The cache folder `<cache_dir>/<kind>-<fingerprint of settings>`, created with its manifest if new.

    Other settings give another folder, so a cache is never reused for other inputs. If the folder exists
    but its `manifest.json` disagrees (a hash collision or a hand-edited cache) we raise rather than guess.
    """
    manifest = _manifest(kind, settings)
    folder = cache_folder(cache_dir, kind, settings)
    manifest_path = folder / "manifest.json"
    if manifest_path.is_file():
        found = json.loads(manifest_path.read_text(encoding="utf-8"))
        if found != json.loads(json.dumps(manifest, sort_keys=True, default=str)):
            raise ValueError(
                f"The cache {folder} was built with other settings (see its manifest.json); delete it or use "
                "another cache_dir."
            )
    else:
        folder.mkdir(parents=True, exist_ok=True)
        _write_json_atomically(manifest, manifest_path)
    return folder


DISK_MARGIN_BYTES = 1 << 30  # left free on the disk for everything else


class NotEnoughDiskForCache(OSError):
    """A data cache would not fit on its disk: raised before any of its work starts."""


def check_disk(cache_dir: str | Path | None, needed_bytes: int, what: str, kind: str | None = None,
               settings: dict[str, Any] | None = None) -> None:
    """Refuse, before any work, a cache of about ``needed_bytes`` that the disk under ``cache_dir`` cannot hold (with
    ``DISK_MARGIN_BYTES`` to spare). Given the cache's ``kind`` and ``settings``, what that cache already holds (the
    shards a killed run finished) counts as written: a resumed build needs only the rest. A no-op without a cache."""
    if cache_dir is None:
        return
    if kind is not None and settings is not None:
        needed_bytes -= _folder_bytes(cache_folder(cache_dir, kind, settings))
    if needed_bytes <= 0:
        return
    folder = Path(cache_dir)
    existing = folder
    while not existing.exists():  # the nearest folder that exists is on the same disk
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed_bytes + DISK_MARGIN_BYTES > free:
        raise NotEnoughDiskForCache(
            f"{what} needs about {needed_bytes / 1e9:.1f} GB under {folder}, and its disk has {free / 1e9:.1f} GB free "
            f"(keeping {DISK_MARGIN_BYTES / 1e9:.1f} GB spare). Free space with `python -m ppow_trl.caches delete "
            "--stale` (`scan` lists what the caches hold), or point $PPOW_TRL_CACHE at a larger disk.")


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Run a block under a fixed torch seed without disturbing the caller's random state."""
    if seed is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _chunk_seed(seed: int, chunk_index: int) -> int:
    """A seed per chunk, so a resumed run draws what an uninterrupted one would have drawn.

    Hashing (rather than `seed + chunk_index`) keeps runs with nearby seeds from sharing chunks' streams.
    """
    return int(hashlib.sha256(f"{seed}/{chunk_index}".encode()).hexdigest()[:15], 16)


def _batches(rows: list[dict[str, Any]], batch_size: int) -> Iterator[list[dict[str, Any]]]:
    for start in range(0, len(rows), batch_size):
        yield rows[start : start + batch_size]


def build_sharded_dataset(
    inputs: Dataset,
    process_batch: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
    *,
    features: Features,
    kind: str,
    settings: dict[str, Any],
    cache_dir: str | Path | None = None,
    batch_size: int = 8,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    seed: int | None = None,
    desc: str | None = None,
    sort_key: Callable[[dict[str, Any]], Any] | None = None,
    unit: str | None = None,
    count: Callable[[list[dict[str, Any]]], int] | None = None,
) -> Dataset:
    """Map `process_batch` over `inputs` chunk by chunk, saving each finished chunk; resume on restart.

    ``sort_key``: the rows of each chunk are sorted by it before they are cut into batches (rows of similar length
    share a batch, so little of it is padding); the output rows come back in input order. ``count`` (with ``unit``, e.g.
    ``"token"``): what one batch's output rows hold, shown with its rate next to the progress bar (tokens/s).

    Rows are cut into chunks of `chunk_size` and each chunk into batches of `batch_size`; `process_batch`
    gets a list of row dicts and returns the output rows (it may drop rows). Each chunk runs under the
    torch seed `_chunk_seed(seed, chunk_index)` (if `seed` is given), so results do not depend on which
    chunks were already cached, nor on whether a cache is used at all.

    Cache layout (when `cache_dir` is given)::

        <cache_dir>/<kind>-<fingerprint>/manifest.json   # kind, format version and `settings`
        <cache_dir>/<kind>-<fingerprint>/shard-00000/    # datasets.save_to_disk of chunk 0
        <cache_dir>/<kind>-<fingerprint>/shard-00001/    # ...

    The fingerprint hashes the manifest, so `settings` must name everything the output depends on
    (model, tokenizer, input data, options, batch and chunk sizes). Shards are written under a temporary
    name private to this process and renamed when complete, so a shard that exists is finished and is
    loaded, never recomputed. Several processes may build the same cache at once (e.g. every rank of a
    launch): the first to finish a shard publishes it, the others discard theirs and load it, so all end
    with the same data. Under several processes (`accelerate launch`, torchrun) with a cache, every process must
    call this with the same inputs: chunk ``i`` is built by rank ``i % world``, a barrier waits for all of them,
    and every rank loads every shard (do not wrap such a call in `main_process_first`, which would leave the
    work to rank 0). The result is the concatenation of the shards (memory-mapped from disk when cached).
    """
    if chunk_size < 1 or batch_size < 1:
        raise ValueError(f"chunk_size and batch_size must be >= 1, got {chunk_size} and {batch_size}.")
    folder = open_cache_folder(cache_dir, kind, settings) if cache_dir is not None else None
    if folder is not None:
        logger.info("Caching %s in %s", kind, folder)
    num_chunks = math.ceil(len(inputs) / chunk_size)
    if folder is None:  # nothing to share or resume: compute in memory
        shards = [_chunk_dataset(inputs, process_batch, features, index, chunk_size, batch_size, seed, desc or kind,
                                 sort_key, unit, count) for index in range(num_chunks)]
    else:
        # Each process builds its share of the missing chunks (chunk i on rank i % world), then all load every shard.
        rank, world = _process_share()
        for index in range(rank, num_chunks, world):
            shard_path = folder / f"shard-{index:05d}"
            if not shard_path.exists():
                _save_atomically(_chunk_dataset(inputs, process_batch, features, index, chunk_size, batch_size, seed,
                                                desc or kind, sort_key, unit, count), shard_path)  # False: another process published it
        if world > 1:
            _wait_for_everyone()
        shards = [_load_quietly(folder / f"shard-{index:05d}", features) for index in range(num_chunks)]
    return concatenate_datasets(shards) if shards else _dataset_from_rows([], features)


def _state():
    """accelerate's process state. Without CUDA it must be created with ``cpu=True``, else every process of a
    torchrun / ``accelerate launch`` sees a world of 1 (accelerate 1.15); an existing state is returned as it is."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def _process_share() -> tuple[int, int]:
    """``(rank, world size)`` under ``accelerate launch`` / torchrun; ``(0, 1)`` in a single process."""
    state = _state()
    return state.process_index, state.num_processes


def _wait_for_everyone() -> None:
    _state().wait_for_everyone()


_ORDER = "__ppow_row_order__"  # a row's place in its chunk while the chunk is processed in length order


def _chunk_dataset(inputs, process_batch, features, chunk_index: int, chunk_size: int, batch_size: int, seed,
                   desc: str, sort_key=None, unit: str | None = None, count=None) -> Dataset:
    """``process_batch`` over one chunk of ``inputs``, under the chunk's own seed, as a dataset."""
    start, stop = chunk_index * chunk_size, min((chunk_index + 1) * chunk_size, len(inputs))
    rank, world = _process_share()
    label = f"{desc} (chunk {chunk_index + 1}/{math.ceil(len(inputs) / chunk_size)}" + (
        f", rank {rank})" if world > 1 else ")")
    rows = inputs.select(range(start, stop)).to_list()
    if sort_key is not None:  # batch by length, then give the rows back in input order (process_batch may drop some)
        for position, row in enumerate(rows):
            row[_ORDER] = position
        rows.sort(key=sort_key)
    outputs, done = [], 0
    with _seeded(None if seed is None else _chunk_seed(seed, chunk_index)), \
            tqdm(total=stop - start, desc=label, unit="example") as progress:
        for batch in _batches(rows, batch_size):
            out = process_batch(batch)
            outputs.extend(out)
            progress.update(len(batch))
            if count is not None:
                done += count(out)
                elapsed = progress.format_dict["elapsed"] or float("nan")
                progress.set_postfix_str(f"{done:,} {unit or 'item'}s, {done / elapsed:,.0f} {unit or 'item'}s/s")
    if sort_key is not None:
        outputs.sort(key=lambda row: row.get(_ORDER, 0))
        for row in outputs:
            row.pop(_ORDER, None)
    return _dataset_from_rows(outputs, features)


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Run a block on the main process first, then on the others: a no-op in a single process.

    Wrap data building in it under `accelerate launch`: the main process builds the cache while the other
    ranks wait at a barrier, then they run the same block and load the finished shards instead of computing
    them. (Without it every rank builds; `build_sharded_dataset` is still correct, just wasteful.) Uses
    `accelerate.PartialState().main_process_first()` when the state reports more than one process.
    """
    state = _state()
    if state.num_processes > 1:
        with state.main_process_first():
            yield
    else:
        yield
