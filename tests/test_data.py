"""Prompt loaders, target-response regeneration, top-k distillation data and their resumable cache."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time

import pytest
import torch
from conftest import make_tiny_llama
from datasets import Dataset, Features, Value, load_from_disk

from ppow_trl import data
from ppow_trl.data import cache
from ppow_trl.data import (
    build_target_responses,
    compute_target_topk,
    encode_prompt,
    load_mtbench,
    load_prompts,
    load_prompts_jsonl,
    load_sharegpt,
    recover_json_records,
    sharegpt_prompts_from_file,
    truncate_at_stop,
)


def _chat(human: str) -> list[dict[str, str]]:
    return [{"from": "human", "value": human}, {"from": "gpt", "value": "answer"}]


def _tiny_prompts(lengths=(3, 1, 7, 2, 5, 4, 6, 1, 2, 3)) -> Dataset:
    """Prompts of different lengths, so that every batch really needs padding."""
    rows = [
        {"id": f"p{i}", "messages": [{"role": "user", "content": " ".join(f"w{(i * 7 + j) % 56}" for j in range(n))}]}
        for i, n in enumerate(lengths)
    ]
    return Dataset.from_list(rows)


@pytest.fixture
def target():
    """A tiny target whose greedy outputs vary and sometimes stop early (the default init repeats one token)."""
    return make_tiny_llama(num_layers=4, seed=0, initializer_range=0.5)


class CountingGenerate:
    """Wraps a model's `generate` to count calls and optionally fail at call number `fail_at`."""

    def __init__(self, model, fail_at: int | None = None):
        self.generate, self.fail_at, self.calls = model.generate, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated interruption")
        return self.generate(*args, **kwargs)


# ------------------------------------------------------------------------------------------------- ShareGPT


def test_recover_json_records_drops_the_partial_record(tmp_path):
    records = [{"id": f"r{i}", "conversations": _chat(f"question {i}")} for i in range(3)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "truncated.json"

    path.write_text(text[: text.index('"r2"') + 20])  # cut inside the third record
    assert recover_json_records(path) == records[:2]

    path.write_text(text[: text.index('"r2"') - 10])  # cut between two records, after the comma
    assert recover_json_records(path) == records[:2]

    path.write_text(text)  # a complete file is read entirely
    assert recover_json_records(path) == records


def test_sharegpt_keeps_only_records_starting_with_a_human_turn(tmp_path):
    records = [
        {"id": "a", "conversations": _chat("first")},
        {"id": "b", "conversations": [{"from": "gpt", "value": "hi"}]},
        {"id": "c", "conversations": _chat("   ")},
        {"id": "d", "conversations": []},
        {"id": "e", "conversations": [{"from": "system", "value": "be nice"}] + _chat("x")},
        {"id": "f", "conversations": _chat("second")},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records)[:-1])  # truncated: no closing bracket
    prompts = sharegpt_prompts_from_file(path)
    assert prompts["id"] == ["a", "f"]
    assert prompts[1]["messages"] == [{"role": "user", "content": "second"}]


def test_load_sharegpt_real_file_splits_and_cache(tmp_path):
    start = time.perf_counter()
    train = load_sharegpt("train", cache_dir=tmp_path)
    first_call = time.perf_counter() - start
    start = time.perf_counter()
    test = load_sharegpt("test", cache_dir=tmp_path)
    second_call = time.perf_counter() - start

    assert len(test) == data.SHAREGPT_TEST_SIZE
    assert 10_500 <= len(train) + len(test) <= 11_500  # ~11,137 usable of ~17,671 recovered records
    assert not set(train["id"]) & set(test["id"])
    assert all(messages[-1]["role"] == "user" and messages[-1]["content"].strip() for messages in test["messages"])
    assert len(list(tmp_path.glob("sharegpt-*"))) == 1
    assert second_call < first_call  # parsed once, then loaded from the cache

    subset = load_sharegpt("train", num_samples=20, seed=1, cache_dir=tmp_path)
    assert subset["id"] == load_sharegpt("train", num_samples=20, seed=1, cache_dir=tmp_path)["id"]
    assert set(subset["id"]) <= set(train["id"])
    with pytest.raises(ValueError, match="split"):
        load_sharegpt("validation", cache_dir=tmp_path)


# ------------------------------------------------------------------------------------------- MT-bench, JSONL


def test_load_mtbench_has_80_questions_in_8_categories():
    questions = load_mtbench()
    assert len(questions) == 80 and len(set(questions["id"])) == 80
    categories = questions["category"]
    assert len(set(categories)) == 8 and all(categories.count(c) == 10 for c in set(categories))
    assert questions[0]["id"] == "81" and questions[0]["messages"][0]["role"] == "user"
    assert load_mtbench(num_samples=2)["id"] == questions["id"][:2]


def test_load_prompts_jsonl_formats_and_errors(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "hello"},
        {},
        {"id": "chat", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                                    {"role": "assistant", "content": "reference answer"}]},
    ]
    path.write_text("\n".join([json.dumps(lines[0]), "", json.dumps(lines[2])]) + "\n")
    prompts = load_prompts_jsonl(path)
    assert prompts["id"] == ["1", "chat"]
    assert prompts[0]["messages"] == [{"role": "user", "content": "hello"}]
    # The trailing reference answer is dropped: the target writes its own.
    assert prompts[1]["messages"] == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert load_prompts(str(path))["id"] == prompts["id"]

    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_prompts_jsonl(tmp_path / "missing.jsonl")
    path.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(ValueError, match="line 2.*'prompt' string or a 'messages' list"):
        load_prompts_jsonl(path)
    path.write_text('{"prompt": "unfinished\n')
    with pytest.raises(ValueError, match="line 1: invalid JSON"):
        load_prompts_jsonl(path)


def test_load_prompts_dispatches():
    assert len(load_prompts("mtbench")) == 80
    assert load_prompts("mtbench", num_samples=3)["id"] == ["81", "82", "83"]
    with pytest.raises(ValueError, match="Unknown prompt source"):
        load_prompts("alpaca")


# ------------------------------------------------------------------------------------------- target responses


def _greedy_single(target, tokenizer, messages, max_new_tokens):
    """Reference: one unpadded prompt through `generate`, cut after the first eos."""
    prompt = torch.tensor([encode_prompt(tokenizer, messages)])
    output = target.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return truncate_at_stop(output[0, prompt.shape[1]:].tolist(), [tokenizer.eos_token_id])


def test_greedy_batched_responses_equal_unbatched_generate(target, tiny_tokenizer):
    prompts = _tiny_prompts()
    responses = build_target_responses(target, tiny_tokenizer, prompts, max_new_tokens=8, batch_size=3, chunk_size=4)
    lengths = [len(ids) for ids in responses["response_ids"]]
    assert min(lengths) < 8 == max(lengths)  # some responses stop at eos, then get padded inside their batch
    assert responses["id"] == prompts["id"]
    assert tiny_tokenizer.padding_side == "right"  # the caller's tokenizer is left alone
    eos = tiny_tokenizer.eos_token_id
    for row in responses:
        assert row["prompt_ids"] == encode_prompt(tiny_tokenizer, row["messages"])
        assert row["response_ids"] == _greedy_single(target, tiny_tokenizer, row["messages"], 8)
        assert 1 <= len(row["response_ids"]) <= 8 and eos not in row["response_ids"][:-1]



def test_batches_hold_prompts_of_similar_length_across_chunks(target, tiny_tokenizer, monkeypatch):
    """``sort_by_length`` sorts the whole dataset before it is cut into chunks: with chunks of one batch, each batch
    holds the next shortest prompts (not a chunk's worth in file order), and the rows still come back in input
    order, equal to unbatched generation."""
    from ppow_trl.data import responses as module

    prompts = _tiny_prompts(lengths=(7, 1, 6, 2, 5, 1, 7, 2))
    seen = []
    encode = module.encode_prompt

    def recording(tokenizer, messages):
        seen.append(len(messages[0]["content"]))
        return encode(tokenizer, messages)

    monkeypatch.setattr(module, "encode_prompt", recording)
    responses = build_target_responses(target, tiny_tokenizer, prompts, max_new_tokens=4, batch_size=2, chunk_size=2)
    assert seen == sorted(seen) and len(seen) == len(prompts)  # batch after batch, shortest first
    assert responses["id"] == prompts["id"]
    for row in responses:
        assert row["response_ids"] == _greedy_single(target, tiny_tokenizer, row["messages"], 4)

def test_long_prompts_are_dropped(target, tiny_tokenizer):
    prompts = _tiny_prompts(lengths=(2, 30, 3))
    responses = build_target_responses(target, tiny_tokenizer, prompts, max_new_tokens=2, max_prompt_length=20)
    assert responses["id"] == ["p0", "p2"]


def test_a_chunk_whose_prompts_are_all_dropped_is_cached_and_read_back(target, tiny_tokenizer, tmp_path):
    """Length-sorted chunks put the long prompts together: a chunk with none left is an empty shard, read back as
    such (a shard saved without data files is not a loadable dataset)."""
    prompts = _tiny_prompts(lengths=(30, 2, 31, 3))
    kwargs = dict(max_new_tokens=2, max_prompt_length=20, batch_size=2, chunk_size=2, cache_dir=tmp_path)
    responses = build_target_responses(target, tiny_tokenizer, prompts, **kwargs)
    assert responses["id"] == ["p1", "p3"]
    assert build_target_responses(target, tiny_tokenizer, prompts, **kwargs).to_list() == responses.to_list()


def test_sampled_responses_are_deterministic_for_a_seed(target, tiny_tokenizer):
    prompts = _tiny_prompts()
    kwargs = dict(max_new_tokens=8, batch_size=2, chunk_size=4, do_sample=True)
    rng_state = torch.random.get_rng_state()
    runs = [build_target_responses(target, tiny_tokenizer, prompts, seed=seed, **kwargs) for seed in (1, 1, 2)]
    assert torch.equal(rng_state, torch.random.get_rng_state())  # the caller's random stream is untouched
    assert runs[0]["response_ids"] == runs[1]["response_ids"] != runs[2]["response_ids"]


def test_responses_resume_after_interruption(target, tiny_tokenizer, tmp_path, monkeypatch):
    prompts = _tiny_prompts()  # 10 prompts: chunks of 4, 4, 2 -> 2 + 2 + 1 generate calls
    kwargs = dict(max_new_tokens=6, batch_size=2, chunk_size=4, do_sample=True, seed=3)
    expected = build_target_responses(target, tiny_tokenizer, prompts, **kwargs)  # uncached, uninterrupted

    monkeypatch.setattr(target, "generate", CountingGenerate(target, fail_at=3))
    with pytest.raises(RuntimeError, match="simulated interruption"):
        build_target_responses(target, tiny_tokenizer, prompts, cache_dir=tmp_path, **kwargs)
    (folder,) = tmp_path.glob("responses-*")
    assert sorted(path.name for path in folder.iterdir()) == ["manifest.json", "shard-00000"]

    counter = CountingGenerate(target)
    monkeypatch.setattr(target, "generate", counter)
    resumed = build_target_responses(target, tiny_tokenizer, prompts, cache_dir=tmp_path, **kwargs)
    assert counter.calls == 3  # chunk 0 came from its shard
    assert resumed.to_list() == expected.to_list()

    counter.calls = 0
    again = build_target_responses(target, tiny_tokenizer, prompts, cache_dir=tmp_path, **kwargs)
    assert again.to_list() == expected.to_list() and counter.calls == 0  # everything cached

    # Other settings: another folder, everything recomputed.
    other = build_target_responses(
        target, tiny_tokenizer, prompts, cache_dir=tmp_path, **{**kwargs, "max_new_tokens": 4}
    )
    assert counter.calls == 5 and len(list(tmp_path.glob("responses-*"))) == 2
    assert all(len(ids) <= 4 for ids in other["response_ids"])


def test_cache_with_a_mismatching_manifest_is_refused(target, tiny_tokenizer, tmp_path):
    prompts = _tiny_prompts(lengths=(2, 3))
    build_target_responses(target, tiny_tokenizer, prompts, max_new_tokens=2, cache_dir=tmp_path)
    (manifest,) = tmp_path.glob("responses-*/manifest.json")
    content = json.loads(manifest.read_text())
    content["settings"]["batch_size"] = 99
    manifest.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="other settings"):
        build_target_responses(target, tiny_tokenizer, prompts, max_new_tokens=2, cache_dir=tmp_path)


def test_model_fingerprint_sees_weights(target):
    before = data.model_fingerprint(target)
    with torch.no_grad():
        target.lm_head.weight[0, 0] += 1.0
    assert data.model_fingerprint(target)["weights"] != before["weights"]


def test_cache_folder_name_is_stable(tmp_path):
    """The folder name is the hash of the manifest: pinned, so a refactor cannot silently orphan existing caches."""
    folder = data.open_cache_folder(tmp_path, "responses", {"model": "m", "batch_size": 2})
    assert folder.name == "responses-ec4811e64d40359f"
    assert sorted(path.name for path in folder.iterdir()) == ["manifest.json"]


# ------------------------------------------------------------------------------------- concurrent builders


_ROWS = Features({"id": Value("string"), "writer": Value("int64")})


def _tagged_rows(rows):
    """Output rows tagged with the writing process, so a test can tell whose shard was published."""
    return [{"id": row["id"], "writer": os.getpid()} for row in rows]


def _leftovers(folder):
    return [path.name for path in folder.rglob("*") if ".tmp" in path.name]


def test_publishing_onto_an_existing_shard_keeps_the_first(tmp_path):
    """The loser of a publish race discards its copy: the destination keeps the winner's data, no temp is left."""
    folder = tmp_path / "shard-00000"
    first = Dataset.from_dict({"id": ["a"], "writer": [1]}, features=_ROWS)
    second = Dataset.from_dict({"id": ["a"], "writer": [2]}, features=_ROWS)
    assert cache._save_atomically(first, folder) is True
    assert cache._save_atomically(second, folder) is False
    assert load_from_disk(str(folder)).to_list() == first.to_list()
    assert cache._write_json_atomically({"v": 1}, tmp_path / "manifest.json") is True
    assert cache._write_json_atomically({"v": 2}, tmp_path / "manifest.json") is False
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"v": 1}
    assert _leftovers(tmp_path) == []


def test_a_shard_published_meanwhile_by_another_process_is_used(tmp_path):
    """Simulated race: while we compute a chunk, another process publishes that shard; we end with theirs."""
    inputs = Dataset.from_dict({"id": [f"p{i}" for i in range(5)]})
    kwargs = dict(features=_ROWS, kind="race", settings={"test": 1}, cache_dir=tmp_path, chunk_size=2, batch_size=2)
    folder = data.open_cache_folder(tmp_path, "race", {"test": 1})

    def process_batch(rows):
        shard = folder / f"shard-{int(rows[0]['id'][1:]) // 2:05d}"
        theirs = [{"id": row["id"], "writer": -1} for row in rows]
        cache._save_atomically(Dataset.from_list(theirs, features=_ROWS), shard)  # the other process wins
        return _tagged_rows(rows)

    built = data.build_sharded_dataset(inputs, process_batch, **kwargs)
    assert built["writer"] == [-1] * 5 and built["id"] == inputs["id"]
    assert data.build_sharded_dataset(inputs, process_batch, **kwargs).to_list() == built.to_list()  # from disk
    assert sorted(path.name for path in folder.iterdir()) == ["manifest.json", "shard-00000", "shard-00001",
                                                              "shard-00002"]


def _build_in_another_process(cache_dir, barrier, results):
    """One of two processes building the same cache; both reach each publish at the same moment."""

    def process_batch(rows):
        barrier.wait(timeout=120)  # both have computed this chunk: they now race to publish it
        return _tagged_rows(rows)

    inputs = Dataset.from_dict({"id": [f"p{i}" for i in range(6)]})
    built = data.build_sharded_dataset(inputs, process_batch, features=_ROWS, kind="race", settings={"test": 2},
                                       cache_dir=cache_dir, chunk_size=3, batch_size=3)
    results.put(built.to_list())


@pytest.mark.slow
def test_two_processes_building_the_same_cache_agree(tmp_path):
    """Two processes (spawned) build the same two-shard cache at once: both end with the published shards."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_build_in_another_process, args=(tmp_path, barrier, results)) for _ in range(2)]
    for worker in workers:
        worker.start()
    outputs = [results.get(timeout=300) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    (folder,) = tmp_path.glob("race-*")
    assert sorted(path.name for path in folder.iterdir()) == ["manifest.json", "shard-00000", "shard-00001"]
    published = [row for shard in ("shard-00000", "shard-00001") for row in load_from_disk(str(folder / shard))]
    assert outputs[0] == outputs[1] == published
    assert [row["id"] for row in published] == [f"p{i}" for i in range(6)]
    assert {row["writer"] for row in published} <= {worker.pid for worker in workers}


def test_main_process_first_is_a_no_op_in_one_process_and_waits_in_several(monkeypatch):
    import accelerate

    calls = []

    class FakeState:
        def __init__(self, num_processes):
            self.num_processes = num_processes

        @contextlib.contextmanager
        def main_process_first(self):
            calls.append("enter")
            yield
            calls.append("exit")

    for num_processes, expected in ((1, []), (2, ["enter", "body", "exit"])):
        calls.clear()
        monkeypatch.setattr(accelerate, "PartialState", lambda n=num_processes, **kwargs: FakeState(n))
        with data.main_process_first():
            calls.append("body")
        assert calls == (expected or ["body"])


# ------------------------------------------------------------------------------------------------ top-k


def test_topk_equals_single_example_forward(target, tiny_tokenizer, tmp_path):
    responses = build_target_responses(target, tiny_tokenizer, _tiny_prompts(), max_new_tokens=6, batch_size=4)
    topk = compute_target_topk(target, responses, top_k=5, batch_size=3, chunk_size=4, cache_dir=tmp_path)
    assert topk["id"] == responses["id"]
    for row in topk:
        prompt, response = row["prompt_ids"], row["response_ids"]
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([prompt + response])).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1)
        values, ids = logprobs.topk(5, dim=-1)
        assert len(row["topk_ids"]) == len(row["topk_logprobs"]) == len(response)
        assert torch.equal(torch.tensor(row["topk_ids"]), ids)
        torch.testing.assert_close(torch.tensor(row["topk_logprobs"]), values, atol=1e-5, rtol=1e-5)
        # Greedy responses: row t's best token is response token t (the rows are aligned).
        assert [candidates[0] for candidates in row["topk_ids"]] == response

    cached = compute_target_topk(target, responses, top_k=5, batch_size=3, chunk_size=4, cache_dir=tmp_path)
    assert cached.to_list() == topk.to_list()
    assert len(list(tmp_path.glob("topk-*/shard-*"))) == 3


# ------------------------------------------------------------------------------------------------ SmolLM2


@pytest.mark.slow
def test_smollm2_regenerates_mtbench_responses():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppow_trl.offline import smollm2_path

    folder = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder)
    prompts = load_mtbench(num_samples=2)
    responses = build_target_responses(target, tokenizer, prompts, max_new_tokens=16, batch_size=2)
    assert tokenizer.padding_side == "right"
    for row in responses:
        assert 1 <= len(row["response_ids"]) <= 16
        assert tokenizer.decode(row["response_ids"], skip_special_tokens=True).strip()
        assert row["response_ids"] == _greedy_single(target, tokenizer, row["messages"], 16)
    topk = compute_target_topk(target, responses, top_k=4, batch_size=2)
    for row in topk:
        assert [candidates[0] for candidates in row["topk_ids"]] == row["response_ids"]


# ------------------------------------------------------------------------------- labels in one pass, teacher-forced


def _brute_force_topk(target, prompt: list[int], response: list[int], k: int):
    """The top-k of one unpadded forward over ``prompt + response`` at the positions predicting the response."""
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([prompt + response])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)], dim=-1).topk(k, dim=-1)


def test_labels_from_generates_own_logits_equal_a_second_forward(target, tiny_tokenizer):
    plain = build_target_responses(target, tiny_tokenizer, _tiny_prompts(), max_new_tokens=6, batch_size=4)
    labelled = build_target_responses(target, tiny_tokenizer, _tiny_prompts(), max_new_tokens=6, batch_size=4,
                                      label_top_k=5)
    assert labelled["response_ids"] == plain["response_ids"]  # labelling does not change what is generated
    for row in labelled:
        values, ids = _brute_force_topk(target, row["prompt_ids"], row["response_ids"], 5)
        assert len(row["topk_ids"]) == len(row["response_ids"])
        assert torch.equal(torch.tensor(row["topk_ids"]), ids)
        torch.testing.assert_close(torch.tensor(row["topk_logprobs"]), values, atol=1e-4, rtol=1e-4)
        assert [candidates[0] for candidates in row["topk_ids"]] == row["response_ids"]  # greedy: aligned



def test_bf16_regeneration_decodes_with_a_bf16_copy_and_leaves_the_target_alone(target, tiny_tokenizer, tmp_path):
    """``precision="bf16"``: the answers are a bf16 copy's greedy text with its own labels (aligned with its text),
    cached apart from the float32 ones; the target keeps its float32 weights."""
    kwargs = dict(max_new_tokens=6, batch_size=4, label_top_k=5, cache_dir=tmp_path)
    fp32 = build_target_responses(target, tiny_tokenizer, _tiny_prompts(), **kwargs)
    bf16 = build_target_responses(target, tiny_tokenizer, _tiny_prompts(), precision="bf16", **kwargs)
    assert next(target.parameters()).dtype == torch.float32
    copy = target.to(torch.bfloat16)
    try:
        for row in bf16:
            assert row["response_ids"] == _greedy_single(copy, tiny_tokenizer, row["messages"], 6)
            assert [candidates[0] for candidates in row["topk_ids"]] == row["response_ids"]
    finally:
        target.float()
    assert len(list(tmp_path.glob("responses-*"))) == 2  # one cache per precision: neither reads the other's
    assert len(bf16) == len(fp32)
    with pytest.raises(ValueError, match="precision"):
        build_target_responses(target, tiny_tokenizer, _tiny_prompts(), precision="fp16")

def _conversations() -> Dataset:
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": " ".join(f"w{(i * 5 + j) % 56}"
                                                                           for j in range(1 + i % 4))}],
             "answer": " ".join(f"w{(i * 3 + j) % 56}" for j in range(n))}
            for i, n in enumerate((4, 0, 9, 2, 6, 1, 7, 3))]
    return Dataset.from_list(rows)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_teacher_forced_labels_equal_one_unpadded_forward_per_sequence(target, tiny_tokenizer, tmp_path, batch_size):
    conversations = _conversations()
    labelled = data.build_teacher_forced(target, tiny_tokenizer, conversations, max_response_tokens=6, top_k=4,
                                         batch_size=batch_size, chunk_size=4, cache_dir=tmp_path)
    assert sorted(labelled["id"]) == sorted(i for i, a in zip(conversations["id"], conversations["answer"]) if a)
    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row in labelled:
        answer = tiny_tokenizer(row["answer"], add_special_tokens=False)["input_ids"]
        assert row["prompt_ids"] == encode_prompt(tiny_tokenizer, row["messages"])
        assert row["response_ids"] == (answer + [end])[:6]  # the answer, the turn's end, cut to 6 tokens
        values, ids = _brute_force_topk(target, row["prompt_ids"], row["response_ids"], 4)
        assert torch.equal(torch.tensor(row["topk_ids"]), ids)
        torch.testing.assert_close(torch.tensor(row["topk_logprobs"]), values, atol=1e-5, rtol=1e-5)
    again = data.build_teacher_forced(target, tiny_tokenizer, conversations, max_response_tokens=6, top_k=4,
                                      batch_size=batch_size, chunk_size=4, cache_dir=tmp_path)
    assert again.to_list() == labelled.to_list()  # read back from the cache
    assert len(list(tmp_path.glob("teacher-forced-*/shard-*"))) == 2


def test_teacher_forced_features_come_from_the_same_forward(target, tiny_tokenizer, tmp_path):
    """feature_layer_ids: each row's hidden states equal those of an unpadded forward over its own prompt + answer
    (brute force, output_hidden_states), and the labels equal those of a run without features."""
    layer_ids = [0, 2, len(target.model.layers)]
    plain = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), max_response_tokens=6, top_k=4,
                                      batch_size=3, cache_dir=tmp_path)
    with_features = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), max_response_tokens=6,
                                              top_k=4, batch_size=3, cache_dir=tmp_path, feature_layer_ids=layer_ids)
    assert len(list(tmp_path.glob("teacher-forced-*"))) == 2  # keyed apart: the labels-only cache keeps its name
    assert with_features.remove_columns("target_features").to_list() == plain.to_list()
    hidden = target.config.hidden_size
    for row in with_features:
        sequence = torch.tensor([row["prompt_ids"] + row["response_ids"]])
        with torch.no_grad():
            states = target(sequence, output_hidden_states=True).hidden_states
        expected = torch.cat([states[i][0] for i in layer_ids], dim=-1)
        stored = torch.from_numpy(row["target_features"]).float()
        assert stored.shape == (sequence.shape[1], len(layer_ids) * hidden)
        assert torch.equal(stored, stored.half().float())  # kept as float16
        torch.testing.assert_close(stored.float(), expected.half().float(), atol=2e-3, rtol=2e-3)
    again = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), max_response_tokens=6, top_k=4,
                                      batch_size=3, cache_dir=tmp_path, feature_layer_ids=layer_ids)
    assert all((a == b).all() for a, b in zip(again["target_features"], with_features["target_features"]))


def test_teacher_forced_bf16_labels_stay_close_to_fp32(target, tiny_tokenizer):
    fp32 = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), top_k=4, precision="fp32")
    bf16 = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), top_k=4, precision="bf16")
    assert bf16["response_ids"] == fp32["response_ids"]
    first = torch.tensor([r[0] for rows in fp32["topk_logprobs"] for r in rows])
    second = torch.tensor([r[0] for rows in bf16["topk_logprobs"] for r in rows])
    assert (first - second).abs().mean() < 0.05  # bf16 matmuls: the same distribution up to rounding
    top1 = [a[0] == b[0] for x, y in zip(fp32["topk_ids"], bf16["topk_ids"]) for a, b in zip(x, y)]
    assert sum(top1) >= 0.9 * len(top1)


def test_teacher_forced_bad_input_fails_before_any_forward(target, tiny_tokenizer):
    with pytest.raises(ValueError, match="answer"):
        data.build_teacher_forced(target, tiny_tokenizer, _tiny_prompts())
    with pytest.raises(ValueError, match="precision"):
        data.build_teacher_forced(target, tiny_tokenizer, _conversations(), precision="fp16")


def test_sharegpt_conversations_carry_the_first_answer_and_keep_the_splits(tmp_path):
    records = [
        {"id": "a", "conversations": _chat("first")},
        {"id": "b", "conversations": [{"from": "human", "value": "alone"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "again"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    rows = sharegpt_prompts_from_file(path, with_answers=True)
    assert rows["id"] == sharegpt_prompts_from_file(path)["id"]  # the same records with and without answers
    assert rows["answer"] == ["answer", "", ""]

    for split in ("train", "test"):
        conversations = data.load_sharegpt_conversations(split, num_samples=30, seed=4, cache_dir=tmp_path)
        prompts = load_sharegpt(split, num_samples=30, seed=4, cache_dir=tmp_path)
        assert conversations["id"] == prompts["id"] and conversations["messages"] == prompts["messages"]
    assert sum(bool(a.strip()) for a in conversations["answer"]) >= 25


def test_a_cache_the_disk_cannot_hold_is_refused_before_any_forward(target, tiny_tokenizer, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 10**6))  # 1 MB free
    calls = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(cache.NotEnoughDiskForCache, match="ppow_trl.caches delete --stale"):
        data.build_teacher_forced(target, tiny_tokenizer, _conversations(), cache_dir=tmp_path / "new" / "folder")
    assert calls == []
    cache.check_disk(None, 10**15, "in memory")  # no cache: nothing to check


def test_a_resumed_cache_needs_only_what_it_has_not_written(target, tiny_tokenizer, tmp_path, monkeypatch):
    """check_disk with the cache's kind and settings subtracts the shards already there: the same build again (all of
    it cached) starts on a disk with no room left, another build of the same size does not."""
    import shutil
    from collections import namedtuple

    data.build_teacher_forced(target, tiny_tokenizer, _conversations(), top_k=4, cache_dir=tmp_path)
    folder = next(tmp_path.glob("teacher-forced-*"))
    written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12, cache.DISK_MARGIN_BYTES))
    settings = json.loads((folder / "manifest.json").read_text())["settings"]
    cache.check_disk(tmp_path, written, "labels", kind="teacher-forced", settings=settings)  # all there: fits
    with pytest.raises(cache.NotEnoughDiskForCache):
        cache.check_disk(tmp_path, written, "labels", kind="teacher-forced", settings={**settings, "top_k": 5})
    again = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), top_k=4, cache_dir=tmp_path)
    assert len(again) == 7  # read back, not refused


def test_target_top1_ids_are_the_first_label_of_every_position(target, tiny_tokenizer):
    labelled = data.build_teacher_forced(target, tiny_tokenizer, _conversations(), top_k=3)
    expected = [ids[0] for rows in labelled["topk_ids"] for ids in rows]
    assert data.target_top1_ids(labelled).tolist() == expected
    assert data.target_top1_ids(labelled.select([])).numel() == 0


def test_length_sorted_batches_come_back_in_input_order(tmp_path):
    rows = Dataset.from_list([{"id": f"r{i}", "n": n} for i, n in enumerate((5, 1, 9, 3, 7, 2, 8))])
    seen = []

    def process(batch):
        seen.append([row["n"] for row in batch])
        return [dict(row, out=row["n"] * 10) for row in batch if row["n"] != 3]  # drops one row

    features = Features({"id": Value("string"), "n": Value("int64"), "out": Value("int64")})
    built = cache.build_sharded_dataset(rows, process, features=features, kind="t", settings={}, cache_dir=tmp_path,
                                        batch_size=2, chunk_size=4, sort_key=lambda row: row["n"])
    assert seen == [[1, 3], [5, 9], [2, 7], [8]]  # each chunk of 4 cut into batches in length order
    assert built["id"] == ["r0", "r1", "r2", "r4", "r5", "r6"] and built["out"] == [50, 10, 90, 70, 20, 80]
