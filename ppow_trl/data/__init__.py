"""Prompts, target-regenerated responses and target top-k distributions for drafter training.

Five modules, each read top to bottom:

- `prompts.py`: the prompt loaders (`load_sharegpt`, `load_mtbench`, `load_prompts_jsonl`, `load_prompts`),
  one schema: `id` (string) and `messages` (a chat ending with a user turn), plus source-specific columns.
- `responses.py`: `build_target_responses` regenerates the responses with the target itself, as EAGLE,
  SpecForge and speculators do: a drafter must learn what *the target* writes (docs/ppow.md "Setting").
- `topk.py`: `compute_target_topk` stores the target's top-k next-token log-probabilities along each
  response, the teacher signal for token-level distillation without keeping the target in memory.
- `teacher_forced.py`: `build_teacher_forced` labels a dataset's own answers (`load_sharegpt_conversations`) with
  the target's top-k in one teacher-forced forward per sequence (EAGLE-1's route): the columns of the two builders
  above at a fraction of their cost.
- `cache.py`: the one resumable, sharded cache both builders run through (`build_sharded_dataset`): work is
  cut into fixed chunks, each finished chunk is saved atomically as
  `<cache_dir>/<kind>-<fingerprint>/shard-00000`, and the fingerprint covers the model, tokenizer, input data
  and settings, so a cache built with other settings is never reused. A restart loads the finished shards
  and computes only the missing ones; several processes building at once agree on one copy
  (`main_process_first` lets the main process build it first).

Held-out data: `load_sharegpt("test")` (alias `"sharegpt-test"`) and MT-bench are evaluation prompts;
train only on `load_sharegpt("train")` (alias `"sharegpt"`) or your own JSONL. The builders never mix
splits: they process exactly the prompts they are given.

Everything below is importable from `ppow_trl.data` directly.
"""

from .cache import (
    CACHE_FORMAT_VERSION,
    DEFAULT_CHUNK_SIZE,
    build_sharded_dataset,
    dataset_fingerprint,
    main_process_first,
    model_fingerprint,
    open_cache_folder,
    tokenizer_fingerprint,
)
from .prompts import (
    MESSAGES_FEATURE,
    MTBENCH_FILE,
    PROMPT_SOURCES,
    SHAREGPT_FILE,
    SHAREGPT_TEST_SIZE,
    load_mtbench,
    load_code_prompts,
    load_prompts,
    load_prompts_jsonl,
    load_sharegpt,
    load_sharegpt_conversations,
    mtbench_question_path,
    recover_json_records,
    sharegpt_json_path,
    sharegpt_prompts_from_file,
    user_messages,
)
from .responses import (
    TOKEN_IDS_FEATURE,
    build_target_responses,
    encode_prompt,
    pad_sequences,
    stop_token_ids,
    truncate_at_stop,
)
from .features import compute_target_features, feature_bytes
from .topk import compute_target_topk, target_top1_ids
from .responses import topk_labels  # noqa: E402  (the labels every builder reads from logits)
from .teacher_forced import LABEL_PRECISIONS, answer_token_ids, build_teacher_forced

__all__ = [
    "CACHE_FORMAT_VERSION",
    "compute_target_features",
    "feature_bytes",
    "DEFAULT_CHUNK_SIZE",
    "MESSAGES_FEATURE",
    "MTBENCH_FILE",
    "PROMPT_SOURCES",
    "SHAREGPT_FILE",
    "SHAREGPT_TEST_SIZE",
    "TOKEN_IDS_FEATURE",
    "build_sharded_dataset",
    "build_target_responses",
    "compute_target_topk",
    "dataset_fingerprint",
    "encode_prompt",
    "load_mtbench",
    "load_code_prompts",
    "load_prompts",
    "load_prompts_jsonl",
    "load_sharegpt",
    "load_sharegpt_conversations",
    "LABEL_PRECISIONS",
    "answer_token_ids",
    "build_teacher_forced",
    "target_top1_ids",
    "topk_labels",
    "main_process_first",
    "model_fingerprint",
    "mtbench_question_path",
    "open_cache_folder",
    "pad_sequences",
    "recover_json_records",
    "sharegpt_json_path",
    "sharegpt_prompts_from_file",
    "stop_token_ids",
    "tokenizer_fingerprint",
    "truncate_at_stop",
    "user_messages",
]
