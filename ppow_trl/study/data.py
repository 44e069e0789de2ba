"""The study's data: one set of target-regenerated responses shared by every arm (cached, resumable).

- train: the target's greedy responses to ShareGPT train prompts (on-policy text: what the target itself
  writes), the tail of which is held out as the trainers' ``eval_dataset`` (calibration of (K, h) and the
  held-out tau curve); KD arms read the target's top-k over the same responses.
- test: the target's greedy continuations of MT-bench first turns and held-out ShareGPT prompts, the text
  on which exact greedy tau is computed for every arm (``exact_greedy_tau(continuation=...)``).

Everything goes through ``build_target_responses`` / ``compute_target_topk``: chunked, cached under
``cache_root()``, a rerun resumes from the last finished chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from datasets import Dataset

from ..data import build_target_responses, compute_target_topk, load_prompts
from ..utils import cache_root


@dataclass(frozen=True)
class StudyData:
    """Sizes of the study's data (a field per knob, recorded in every result file)."""

    num_train_prompts: int = 640
    train_max_new_tokens: int = 128
    num_calibration: int = 48
    num_mtbench: int = 80
    num_sharegpt_test: int = 200
    eval_max_new_tokens: int = 128
    top_k: int = 32
    seed: int = 0
    batch_size: int = 8


def train_responses(target, tokenizer, spec: StudyData) -> tuple[Dataset, Dataset]:
    """(train, calibration) splits of the target's greedy responses to ShareGPT train prompts."""
    prompts = load_prompts("sharegpt", num_samples=spec.num_train_prompts, seed=spec.seed)
    data = build_target_responses(target, tokenizer, prompts, max_new_tokens=spec.train_max_new_tokens,
                                  batch_size=spec.batch_size, cache_dir=cache_root() / "responses")
    data = data.filter(lambda row: len(row["response_ids"]) >= 8)  # too short to hold a window
    cut = len(data) - spec.num_calibration
    if cut < 1:
        raise ValueError(f"{len(data)} usable train responses: raise num_train_prompts above num_calibration.")
    return data.select(range(cut)), data.select(range(cut, len(data)))


def train_topk(target, train: Dataset, spec: StudyData) -> Dataset:
    """The target's top-k distributions teacher-forced over the train responses (the KD arms' teacher)."""
    return compute_target_topk(target, train, top_k=spec.top_k, batch_size=spec.batch_size,
                               cache_dir=cache_root() / "topk")


def test_sets(target, tokenizer, spec: StudyData) -> dict[str, Dataset]:
    """{'mtbench': ..., 'sharegpt_test': ...}: the target's greedy text on the held-out prompts.

    Responses stop at the target's stop token or after ``eval_max_new_tokens``: exact greedy tau needs the
    text only up to the first EOS (the loop stops there).
    """
    sets = {"mtbench": load_prompts("mtbench", num_samples=spec.num_mtbench),
            "sharegpt_test": load_prompts("sharegpt-test", num_samples=spec.num_sharegpt_test, seed=spec.seed)}
    return {name: build_target_responses(target, tokenizer, prompts, max_new_tokens=spec.eval_max_new_tokens,
                                         batch_size=spec.batch_size, cache_dir=cache_root() / "responses")
            for name, prompts in sets.items()}


def train_features(target, train: Dataset, layer_ids: list[int], spec: StudyData) -> Dataset:
    """``train`` plus the target's hidden states at ``layer_ids`` (float16, cached): the EAGLE-3 arms' inputs."""
    from ..data import compute_target_features

    return compute_target_features(target, train, layer_ids, batch_size=spec.batch_size,
                                   cache_dir=cache_root() / "features")
