"""HF assisted generation with a saved PPOW drafter: `target.generate(..., assistant_model=load_assistant(folder))`.

Checks: the hook is a real module copied verbatim into the folder and importing only torch / transformers; the
folder carries the policy; `load_assistant` runs no code from the folder by default and still applies the rule;
greedy output equals the target's own greedy output (EOS inside windows included); the adaptive rule decides how
many tokens each round drafts (a spy on the drafter's `generate`, which HF's loop calls once per round), with the
policy's confidence temperature T_c, greedy or sampled; sampling keeps the target's distribution; the
reduced-vocabulary drafter works through the same hook (with and without ppow_trl importable); old policy files;
Hub repo ids (a fake `hf_hub_download`, no network); the model card's snippets; the trl version check; bad input.
"""

import ast
import copy
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

import ppow_trl.core.custom_generate.generate as hook_module
from conftest import (easy_hard_bigram_table, make_bigram_llama, make_target_and_drafters,
                      make_tiny_tokenizer)
from ppow_trl._compat import SUPPORTED_TRL_RANGE, check_trl_version
from ppow_trl.serving.assisted import (
    CUSTOM_GENERATE_FILE,
    GENERATION_CONFIG_KEY,
    HOOK_SOURCE,
    MODELING_FILE,
    attach_window_policy,
    load_assistant,
    load_cost_model,
    save_assistant,
    write_assistant_files,
)
from ppow_trl.core.cost import COST_MODEL_FILE, CostModel
from ppow_trl.drafter import PPOWDrafterForCausalLM
from ppow_trl.training.model_card import render_model_card
from ppow_trl.models import make_drafter
from ppow_trl.core.windowing import WINDOW_POLICY_FILE, AdaptiveWindowPolicy

REPO_ROOT = Path(__file__).resolve().parents[1]
EOS = 3  # make_tiny_llama's eos_token_id
COST = CostModel(drafter_cost=0.2, verify_cost=[1.0, 1.1, 1.2], description="test")


def make_models(seed=0):
    return make_target_and_drafters(seed, noise=0.02)


@pytest.fixture(scope="module")
def models():
    return make_models()


def prompts(n=20, seed=0, vocab=64, max_len=8):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, max_len + 1, (1,), generator=g))
        out.append(torch.randint(8, vocab, (1, length), generator=g))
    return out


def generate(target, ids, **kwargs):
    return target.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kwargs)


def saved_and_loaded(drafter, folder, max_window, threshold, confidence_temperature=1.0):
    """``load_assistant(save_assistant(copy of drafter, folder, policy=AdaptiveWindowPolicy(K, h, T_c)))``."""
    policy = AdaptiveWindowPolicy(max_window, threshold, confidence_temperature)
    return load_assistant(save_assistant(copy.deepcopy(drafter), folder, policy=policy))


def is_ppow_hook(model):
    """Whether ``model.generate`` is ppow_trl's own hook (not a copy transformers imported from a folder)."""
    hook = model.__dict__.get("generate")
    return isinstance(hook, functools.partial) and hook.func is hook_module.generate


def without_eos(target, assistant):
    """No EOS anywhere (a drafter whose own generation config keeps one stops drafting at it, as HF does)."""
    target.generation_config.eos_token_id = None
    assistant.generation_config.eos_token_id = None


def spy(drafter):
    """Record every drafting round HF's assisted loop asks for: (prompt length, cap, drafted tokens, scores)."""
    rounds = []
    hook = drafter.generate

    def recording(*args, **kwargs):
        out = hook(*args, **kwargs)
        start = kwargs["input_ids"].shape[1]
        rounds.append(
            {"start": start, "cap": kwargs["max_new_tokens"], "sequence": out.sequences[0], "scores": out.scores}
        )
        return out

    drafter.generate = recording
    return rounds


def teacher_forced_logits(drafter, sequence, start):
    """The drafter's raw logits ``z`` for each drafted token ``sequence[start:]``, from one forward."""
    with torch.no_grad():
        return drafter(sequence[None]).logits[0, start - 1 : len(sequence) - 1].float()


def teacher_forced_confidences(drafter, sequence, start, temperature=1.0):
    """``max softmax(logits / T)`` of the drafter for each drafted token ``sequence[start:]``, from one forward."""
    return torch.softmax(teacher_forced_logits(drafter, sequence, start) / temperature, dim=-1).amax(dim=-1)


def top_k_only(logits, k):
    """``logits`` with all but the ``k`` largest entries of each row at ``-inf`` (what TopKLogitsWarper keeps)."""
    if not k:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def expected_length(policy, confidences, cap):
    """``policy.window_lengths`` on one round's confidences (zeros past the drafted ones), capped like HF caps."""
    padded = torch.zeros(1, policy.max_window)
    padded[0, : len(confidences)] = confidences[: policy.max_window]
    return min(int(policy.window_lengths(padded)[0]), cap)


# ----------------------------------------------------------------------------------------------- the folder


def test_save_writes_policy_costs_hook_and_generation_config_and_reloads(tmp_path, models):
    _, drafter, _ = models
    drafter = copy.deepcopy(drafter)
    policy = AdaptiveWindowPolicy(max_window=5, threshold=0.35)
    folder = save_assistant(drafter, tmp_path / "d", policy=policy, cost_model=COST, tokenizer=make_tiny_tokenizer())
    assert folder == tmp_path / "d"
    for name in (WINDOW_POLICY_FILE, "ppow_cost_model.json", CUSTOM_GENERATE_FILE, "generation_config.json",
                 "config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).is_file(), name
    assert not (folder / MODELING_FILE).exists()  # only reduced-vocabulary drafters need their class file
    saved = json.loads((folder / "generation_config.json").read_text())
    assert saved["num_assistant_tokens"] == 5 and saved["num_assistant_tokens_schedule"] == "constant"
    assert saved["assistant_confidence_threshold"] == 0.0  # HF's per-token rule (default 0.4) is off
    # the tokenizer's length: the hook's confidences cover those scores only
    stored = {"max_window": 5, "threshold": 0.35, "confidence_temperature": 1.0, "vocab_size": 64}
    assert saved[GENERATION_CONFIG_KEY] == stored
    assert saved["eos_token_id"] == EOS  # the model's own generation settings are kept
    assert drafter.generation_config.num_assistant_tokens == 5  # the in-memory drafter is set too
    # the folder's hook is the package's module, byte for byte
    hook_file = REPO_ROOT / "ppow_trl" / "core" / "custom_generate" / "generate.py"
    assert HOOK_SOURCE == Path(hook_module.__file__) == hook_file
    assert (folder / CUSTOM_GENERATE_FILE).read_bytes() == HOOK_SOURCE.read_bytes()

    loaded = load_assistant(folder)
    assert is_ppow_hook(loaded)  # no remote code: ppow_trl's own hook, installed in memory
    assert AdaptiveWindowPolicy.from_pretrained(folder) == policy
    assert getattr(loaded.generation_config, GENERATION_CONFIG_KEY) == stored
    assert loaded.generation_config.assistant_confidence_threshold == 0.0
    assert load_cost_model(folder) == COST
    assert load_cost_model(tmp_path) is None
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


# ------------------------------------------------------------------------------------------ losslessness


@pytest.mark.parametrize("max_window,threshold", [(1, 0.0), (4, 0.3), (6, 0.0), (3, 1.0)])
def test_greedy_output_equals_the_targets_own(tmp_path, models, max_window, threshold):
    target, random_drafter, close_drafter = models
    policy = AdaptiveWindowPolicy(max_window, threshold)
    for name, drafter in (("random", random_drafter), ("close", close_drafter)):
        assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / name, policy=policy))
        for ids in prompts(20):
            reference = generate(target, ids, do_sample=False, max_new_tokens=12)
            assisted = generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=12)
            assert torch.equal(assisted, reference), (name, ids)


def test_greedy_lossless_with_eos_inside_windows(tmp_path, models):
    """A frequent token as EOS; the close drafter proposes it inside long windows, and HF stops there."""
    target, _, close_drafter = models
    target = copy.deepcopy(target)
    texts = [
        generate(target, ids, do_sample=False, max_new_tokens=12, eos_token_id=None)[0, ids.shape[1] :]
        for ids in prompts(20)
    ]
    eos = int(torch.cat(texts).mode().values)
    target.generation_config.eos_token_id = eos
    assistant = saved_and_loaded(close_drafter, tmp_path / "d", 6, 0.0)
    rounds = spy(assistant)
    stopped_early = 0
    for ids in prompts(20):
        reference = generate(target, ids, do_sample=False, max_new_tokens=12)
        assisted = generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=12)
        assert torch.equal(assisted, reference), ids
        stopped_early += reference.shape[1] < ids.shape[1] + 12
    assert stopped_early >= 3
    # EOS was drafted inside a window (not only as the target's correction token), the window ended there
    inside = [r for r in rounds if eos in r["sequence"][r["start"]:].tolist()]
    assert inside and all(r["sequence"][-1] == eos for r in inside)


# --------------------------------------------------------------------------------- the rule is applied


def check_rounds_follow_the_policy(rounds, drafter, policy, do_sample, temperature, top_k=0):
    """Every recorded round drafted ``policy.window_lengths(policy.confidence(z))`` tokens (capped like HF caps),
    ``z`` the drafter's raw teacher-forced logits (top-k truncated when top-k is in effect); the scores HF got are
    ``z / T`` (sampling) or ``z`` (greedy): the drafter is warped once. Returns the lengths."""
    lengths = []
    for r in rounds:
        drafted = len(r["sequence"]) - r["start"]
        logits = top_k_only(teacher_forced_logits(drafter, r["sequence"], r["start"]), top_k if do_sample else 0)
        processed = torch.softmax(logits / (temperature if do_sample else 1.0), dim=-1)
        recorded = torch.stack([torch.softmax(score[0].float(), -1) for score in r["scores"]])
        torch.testing.assert_close(recorded, processed, atol=1e-5, rtol=1e-5)
        assert drafted == expected_length(policy, policy.confidence(logits), r["cap"]), r
        lengths.append(drafted)
    return lengths


@pytest.mark.parametrize("do_sample,temperature", [(False, 1.0), (True, 0.7)])
@pytest.mark.parametrize("max_window,threshold", [(5, 0.3), (6, 0.15), (4, 0.5)])
def test_each_round_drafts_the_policys_window_length(tmp_path, models, do_sample, temperature, max_window, threshold):
    """Window lengths equal `policy.window_lengths` of the drafter's own confidences, recomputed independently
    from a teacher-forced forward: ``max softmax(z / T_c)`` with T_c = 1, whatever the sampling temperature."""
    target, drafter, _ = models
    target = copy.deepcopy(target)
    policy = AdaptiveWindowPolicy(max_window, threshold)
    assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / "d", policy=policy))
    without_eos(target, assistant)  # EOS also ends windows (tested above)
    rounds = spy(assistant)
    torch.manual_seed(0)
    sample_kwargs = {"temperature": temperature, "top_k": 0} if do_sample else {}
    for ids in prompts(8):
        generate(target, ids, assistant_model=assistant, do_sample=do_sample, max_new_tokens=20, **sample_kwargs)
    lengths = check_rounds_follow_the_policy(rounds, drafter, policy, do_sample, temperature)
    assert len(set(lengths)) >= 3  # the rule really varies the windows here


@pytest.mark.parametrize(
    "do_sample,temperature,top_k", [(False, 1.0, 0), (True, 0.7, 0), (True, 1.6, 0), (True, 0.7, 5)]
)
@pytest.mark.parametrize("confidence_temperature,threshold", [(0.5, 0.5), (2.0, 0.1)])
def test_the_hook_uses_the_policys_confidence_temperature(
    tmp_path, models, do_sample, temperature, top_k, confidence_temperature, threshold
):
    """T_c != 1 in the hook: the lengths it picks are `policy.window_lengths(policy.confidence(raw logits))`, greedy
    and sampled (the hook undoes the sampling temperature HF applied to the scores), and differ from the lengths of
    T_c = 1 somewhere (so T_c really reached the hook). With top-k in effect the confidences are those of the
    truncated distribution (the module docstring says so)."""
    target, drafter, _ = models
    target = copy.deepcopy(target)
    policy = AdaptiveWindowPolicy(6, threshold, confidence_temperature)
    assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / "d", policy=policy))
    stored = getattr(assistant.generation_config, GENERATION_CONFIG_KEY)
    assert stored["confidence_temperature"] == confidence_temperature
    without_eos(target, assistant)
    rounds = spy(assistant)
    torch.manual_seed(0)
    sample_kwargs = {"temperature": temperature, "top_k": top_k} if do_sample else {}
    for ids in prompts(6):
        generate(target, ids, assistant_model=assistant, do_sample=do_sample, max_new_tokens=16, **sample_kwargs)
    lengths = check_rounds_follow_the_policy(rounds, drafter, policy, do_sample, temperature, top_k)
    assert len(set(lengths)) >= 2
    at_one = AdaptiveWindowPolicy(6, threshold)  # same (K, h), T_c = 1
    differs = 0
    for r in rounds:
        logits = top_k_only(teacher_forced_logits(drafter, r["sequence"], r["start"]), top_k if do_sample else 0)
        differs += expected_length(at_one, at_one.confidence(logits), r["cap"]) != len(r["sequence"]) - r["start"]
    assert differs > 0


def test_the_criterion_recovers_raw_logits_from_processed_scores():
    """`PPOWWindowCriteria` on scores z / T (sampling) or z (greedy), -inf entries included, stops where
    `AdaptiveWindowPolicy.window_lengths(policy.confidence(z))` says."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(40, 6, 32, generator=g) * 3
    z[..., :4] = float("-inf")  # outside a reduced vocabulary, or removed by top-k
    for confidence_temperature, threshold, do_sample, temperature in [
        (1.0, 0.3, False, 1.0), (0.5, 0.6, False, 1.0), (2.0, 0.05, True, 0.7), (0.7, 0.4, True, 1.8),
    ]:
        policy = AdaptiveWindowPolicy(6, threshold, confidence_temperature)
        expected = policy.window_lengths(policy.confidence(z))
        scale = temperature if do_sample else 1.0
        for row in range(z.shape[0]):
            criteria = hook_module.PPOWWindowCriteria(6, threshold, confidence_temperature, do_sample, temperature)
            scores, ids = (), torch.zeros(1, 1, dtype=torch.long)
            while True:
                scores += (z[row, len(scores)][None] / scale,)
                if bool(criteria(ids, scores)[0]):
                    break
            assert len(scores) == int(expected[row]), (row, confidence_temperature, do_sample)
        assert len(set(expected.tolist())) >= 3


@pytest.mark.parametrize("threshold,expected", [(1.0, "one"), (0.0, "K")])
def test_threshold_one_gives_single_tokens_and_zero_gives_full_windows(tmp_path, models, threshold, expected):
    target, drafter, _ = models
    target = copy.deepcopy(target)
    assistant = saved_and_loaded(drafter, tmp_path / "d", 5, threshold)
    without_eos(target, assistant)
    rounds = spy(assistant)
    for ids in prompts(5):
        generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=16)
    for r in rounds:
        drafted = len(r["sequence"]) - r["start"]
        assert drafted == (1 if expected == "one" else min(5, r["cap"]))


def test_hf_confidence_threshold_set_later_does_not_cut_our_windows(tmp_path, models):
    target, drafter, _ = models
    target = copy.deepcopy(target)
    assistant = saved_and_loaded(drafter, tmp_path / "d", 4, 0.0)
    without_eos(target, assistant)
    assistant.generation_config.assistant_confidence_threshold = 0.99  # would stop every window after 1 token
    rounds = spy(assistant)
    for ids in prompts(3):
        generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=12)
    assert all(len(r["sequence"]) - r["start"] == min(4, r["cap"]) for r in rounds)


def test_direct_generate_of_the_drafter_is_unchanged(tmp_path, models):
    """The rule applies only when HF calls the drafter as an assistant."""
    _, drafter, _ = models
    assistant = saved_and_loaded(drafter, tmp_path / "d", 2, 1.0)
    ids = prompts(1)[0]
    out = generate(assistant, ids, do_sample=False, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(out, generate(drafter, ids, do_sample=False, max_new_tokens=10, eos_token_id=None))


def test_plain_from_pretrained_route_and_in_memory_attach(tmp_path, models):
    """What a user writes: `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`; without
    trust_remote_code HF's fixed window of K applies; `attach_window_policy` installs the same hook in memory."""
    from transformers import AutoModelForCausalLM

    target, drafter, _ = models
    target = copy.deepcopy(target)
    policy = AdaptiveWindowPolicy(4, 1.0)
    folder = tmp_path / "d"
    copy.deepcopy(drafter).save_pretrained(folder)  # weights only, then the files the trainer writes
    write_assistant_files(folder, policy, COST)
    ids = prompts(1)[0]
    for model, windows in (
        (AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True), {1}),
        (AutoModelForCausalLM.from_pretrained(folder), {4}),  # no hook: HF's constant K
        (attach_window_policy(copy.deepcopy(drafter), policy), {1}),
    ):
        without_eos(target, model)
        rounds = spy(model)
        out = generate(target, ids, assistant_model=model, do_sample=False, max_new_tokens=12)
        assert torch.equal(out, generate(target, ids, do_sample=False, max_new_tokens=12))
        assert {len(r["sequence"]) - r["start"] for r in rounds if r["cap"] >= 4} == windows


# -------------------------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_runs_and_keeps_the_targets_first_token_distribution(tmp_path, temperature):
    """Bigram target and a different bigram drafter: the first sampled token after the prompt follows the target's
    distribution at the sampling temperature (chi-square), although drafts are often rejected (residual sampling)."""
    table = easy_hard_bigram_table(seed=0)
    table[50] = -10.0
    table[50, 10:18] = torch.linspace(4.0, 1.0, 8)  # not uniform: the temperature matters
    target = make_bigram_llama(table)
    drafter_table = easy_hard_bigram_table(seed=1)
    drafter_table[50] = torch.linspace(-2.0, 3.0, 64)  # far from the target's row
    policy = AdaptiveWindowPolicy(3, 0.0)
    assistant = load_assistant(save_assistant(make_bigram_llama(drafter_table), tmp_path / "d", policy=policy))
    ids = torch.tensor([[12, 50]])
    with torch.no_grad():
        p = torch.softmax(target(ids).logits[0, -1] / temperature, -1)
    support = list(range(10, 18))
    torch.manual_seed(0)
    n = 400
    counts = torch.zeros(64)
    for _ in range(n):
        out = generate(target, ids, assistant_model=assistant, do_sample=True, temperature=temperature,
                       max_new_tokens=3, eos_token_id=None)
        assert out.shape == (1, 5)
        counts[int(out[0, 2])] += 1
    assert counts[support].sum() == n  # p outside the support is ~e^-14
    expected = p[support].double() / p[support].double().sum() * n
    assert chisquare(counts[support].tolist(), expected.tolist()).pvalue > 1e-3


# ------------------------------------------------------------------------------ the hook module itself


def test_the_hook_is_a_self_contained_module_of_the_package():
    """It imports only the standard library, torch and transformers (it runs where ppow_trl is not installed), is
    found by `packages = find:` (so it is installed), and keeps the rule's two functions windowing imports."""
    from setuptools import find_packages

    tree = ast.parse(HOOK_SOURCE.read_text())
    imported = {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
    assert imported - {"torch", "transformers"} <= sys.stdlib_module_names, imported
    assert "ppow_trl.core.custom_generate" in find_packages(where=str(REPO_ROOT), include=["ppow_trl*"])
    import ppow_trl.core.windowing as windowing

    assert windowing.window_confidence is hook_module.window_confidence
    assert windowing.keep_drafting is hook_module.keep_drafting
    assert "GENERATE_PY" not in vars(sys.modules["ppow_trl.serving.assisted"])


def test_load_assistant_runs_no_folder_code_by_default(tmp_path, models):
    """A folder whose custom_generate/generate.py would fail if executed: `load_assistant(folder)` never runs it and
    still applies the adaptive rule (h = 1: one token per round; h = 0: K), losslessly; opting into remote code runs
    it (transformers imports it)."""
    target, drafter, _ = models
    target = copy.deepcopy(target)
    for threshold, windows in ((1.0, {1}), (0.0, {4})):
        folder = save_assistant(copy.deepcopy(drafter), tmp_path / f"d{threshold}",
                                policy=AdaptiveWindowPolicy(4, threshold, 0.7))
        hook_file = folder / CUSTOM_GENERATE_FILE
        hook_file.write_text(hook_file.read_text() + f"\nraise RuntimeError('folder code executed {threshold}')\n")
        assistant = load_assistant(folder)
        assert is_ppow_hook(assistant)
        without_eos(target, assistant)
        rounds = spy(assistant)
        for ids in prompts(4):
            assert torch.equal(
                generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=12),
                generate(target, ids, do_sample=False, max_new_tokens=12),
            )
        assert {len(r["sequence"]) - r["start"] for r in rounds if r["cap"] >= 4} == windows
        with pytest.raises(RuntimeError, match="folder code executed"):
            load_assistant(folder, trust_remote_code=True)


def test_old_policy_files_without_confidence_temperature_load_with_one(tmp_path, models):
    """Folders saved before T_c existed: policy file and generation config hold only K and h."""
    from transformers import AutoModelForCausalLM

    target, drafter, _ = models
    target = copy.deepcopy(target)
    folder = save_assistant(copy.deepcopy(drafter), tmp_path / "old", policy=AdaptiveWindowPolicy(6, 0.3))
    (folder / WINDOW_POLICY_FILE).write_text(json.dumps({"max_window": 6, "threshold": 0.3}))
    config = json.loads((folder / "generation_config.json").read_text())
    config[GENERATION_CONFIG_KEY] = {"max_window": 6, "threshold": 0.3}
    (folder / "generation_config.json").write_text(json.dumps(config))
    assert AdaptiveWindowPolicy.from_pretrained(folder) == AdaptiveWindowPolicy(6, 0.3, 1.0)
    policy = AdaptiveWindowPolicy(6, 0.3)
    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # the folder's own hook
    assert hook_module.ppow_window_policy(remote)["confidence_temperature"] == 1.0
    loaded = load_assistant(folder)
    assert getattr(loaded.generation_config, GENERATION_CONFIG_KEY)["confidence_temperature"] == 1.0
    for model in (remote, loaded):
        without_eos(target, model)
        rounds = spy(model)
        for ids in prompts(4):
            generate(target, ids, assistant_model=model, do_sample=False, max_new_tokens=16)
        check_rounds_follow_the_policy(rounds, drafter, policy, do_sample=False, temperature=1.0)


# ------------------------------------------------------------------------------------------------- the Hub

REVISION = "0123456789abcdef0123456789abcdef01234567"  # a commit hash, as the model card recommends


class FakeHub:
    """`hf_hub_download` serving files of local folders published as (repo_id, revision); no network.

    Like the real one it copies the file into the HF cache layout (``cache_dir/models--owner--name/snapshots/
    <commit>/file``), which transformers reads back; a file missing at that revision raises EntryNotFoundError.
    """

    def __init__(self, default_cache):
        self.repos = {}
        self.calls = []
        self.default_cache = Path(default_cache)

    def publish(self, repo_id, folder, revision=REVISION):
        self.repos[(repo_id, revision)] = Path(folder)

    def hf_hub_download(self, repo_id, filename, *, subfolder=None, revision=None, cache_dir=None, **kwargs):
        from huggingface_hub.errors import EntryNotFoundError

        revision = None if revision is None else str(revision)  # transformers passes a ResolvedRevision (a str)
        self.calls.append({"repo_id": repo_id, "filename": filename, "revision": revision, "cache_dir": cache_dir,
                           **kwargs})
        filename = f"{subfolder}/{filename}" if subfolder else filename
        source = self.repos.get((repo_id, revision or "main"))
        if source is None or not (source / filename).is_file():
            raise EntryNotFoundError(f"{filename} is not in {repo_id} at revision {revision}.")
        commit = revision if re.fullmatch(r"[0-9a-f]{40}", revision or "") else hashlib.sha1(
            (revision or "main").encode()).hexdigest()
        repo_cache = Path(cache_dir or self.default_cache) / f"models--{repo_id.replace('/', '--')}"
        if commit != revision:
            (repo_cache / "refs").mkdir(parents=True, exist_ok=True)
            (repo_cache / "refs" / (revision or "main")).write_text(commit)
        path = repo_cache / "snapshots" / commit / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / filename, path)
        return str(path)


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """The fake replaces `hf_hub_download` where ppow_trl (`huggingface_hub.hf_hub_download`, imported at call time)
    and transformers (`transformers.utils.hub`) look it up; any socket connection fails the test."""
    import huggingface_hub
    import transformers.utils.hub

    hub = FakeHub(tmp_path / "default-cache")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub.hf_hub_download)
    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", hub.hf_hub_download)

    def no_network(*args, **kwargs):
        raise AssertionError(f"a test tried to open a network connection: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return hub


def test_policy_and_cost_model_load_from_a_hub_repo_id(tmp_path, fake_hub):
    policy = AdaptiveWindowPolicy(5, 0.25, 0.8, calibration={"regime": "greedy", "num_contexts": 3})
    folder = tmp_path / "published"
    policy.save_pretrained(folder)
    COST.save_pretrained(folder)
    fake_hub.publish("me/ppow-drafter", folder)
    hub = {"revision": REVISION, "token": "hf_fake", "cache_dir": str(tmp_path / "cache")}
    assert AdaptiveWindowPolicy.from_pretrained("me/ppow-drafter", **hub) == policy
    assert CostModel.from_pretrained("me/ppow-drafter", **hub) == COST
    assert load_cost_model("me/ppow-drafter", **hub) == COST
    assert [(c["filename"], c["revision"], c["token"], c["cache_dir"]) for c in fake_hub.calls] == [
        (WINDOW_POLICY_FILE, REVISION, "hf_fake", hub["cache_dir"]),
        (COST_MODEL_FILE, REVISION, "hf_fake", hub["cache_dir"]),
        (COST_MODEL_FILE, REVISION, "hf_fake", hub["cache_dir"]),
    ]
    # another revision does not have these files; a repo without a cost model gives None
    with pytest.raises(FileNotFoundError, match=WINDOW_POLICY_FILE):
        AdaptiveWindowPolicy.from_pretrained("me/ppow-drafter", revision="f" * 40)
    (folder / COST_MODEL_FILE).unlink()
    assert load_cost_model("me/ppow-drafter", revision=REVISION) is None


def test_load_assistant_from_a_hub_repo_id(tmp_path, models, fake_hub):
    """`load_assistant("owner/name", revision=<commit>)`: weights, generation config, policy all fetched at that
    revision; the rule applies (h = 1: single tokens) and the output is the target's greedy output."""
    target, drafter, _ = models
    target = copy.deepcopy(target)
    policy = AdaptiveWindowPolicy(4, 1.0, 0.6)
    fake_hub.publish("me/ppow-drafter", save_assistant(copy.deepcopy(drafter), tmp_path / "published", policy=policy,
                                                       cost_model=COST))
    cache = str(tmp_path / "cache")
    assistant = load_assistant("me/ppow-drafter", revision=REVISION, cache_dir=cache)
    assert is_ppow_hook(assistant)
    assert getattr(assistant.generation_config, GENERATION_CONFIG_KEY) == {
        "max_window": 4, "threshold": 1.0, "confidence_temperature": 0.6}
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, assistant.state_dict()[name]), name
    fetched = {c["filename"] for c in fake_hub.calls}
    assert {WINDOW_POLICY_FILE, "config.json", "model.safetensors"} <= fetched
    assert all(c["revision"] == REVISION for c in fake_hub.calls), fake_hub.calls
    assert all(c["cache_dir"] == cache for c in fake_hub.calls if c["filename"] != "adapter_config.json")
    without_eos(target, assistant)
    rounds = spy(assistant)
    ids = prompts(1)[0]
    assert torch.equal(generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=10),
                       generate(target, ids, do_sample=False, max_new_tokens=10))
    assert rounds and all(len(r["sequence"]) - r["start"] == 1 for r in rounds)
    with pytest.raises(FileNotFoundError, match=WINDOW_POLICY_FILE):
        load_assistant("me/ppow-drafter", revision="f" * 40)


def card_for(tmp_path, adapter):
    class Args:
        max_window, window_threshold, learning_rate = 4, 0.3, 1e-4

    return render_model_card(model_name="ppow-drafter", target="tiny-target", drafter="tiny drafter", data="tiny",
                             args=Args(), policy=AdaptiveWindowPolicy(4, 0.3, 0.8), cost_model=COST,
                             hub_model_id="me/ppow-drafter", adapter=adapter)


def test_adapter_model_card_loads_policy_and_cost_model_from_the_hub(tmp_path, fake_hub):
    """The adapter card's own lines `AdaptiveWindowPolicy.from_pretrained("<hub id>", revision=revision)` and
    `CostModel.from_pretrained(...)`, executed as written, fetch the files at the card's revision."""
    card = card_for(tmp_path, adapter=True)
    assert "LoRA adapter" in card and "merge_and_unload" in card and "trust_remote_code=True" in card
    assert "commit hash" in card and "T_c = 0.8" in card
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    starts = ("revision =", "policy =", "cost_model =", "from ppow_trl.core.windowing", "from ppow_trl.core.cost")
    wanted = [line for line in code.splitlines() if line.startswith(starts)]
    assert len(wanted) == 5 and 'AdaptiveWindowPolicy.from_pretrained("me/ppow-drafter", revision=revision)' in code
    folder = tmp_path / "adapter"
    AdaptiveWindowPolicy(4, 0.3, 0.8).save_pretrained(folder)
    COST.save_pretrained(folder)
    fake_hub.publish("me/ppow-drafter", folder, revision="main")  # the card's placeholder revision
    namespace = {}
    exec("\n".join(wanted), namespace)
    assert namespace["policy"] == AdaptiveWindowPolicy(4, 0.3, 0.8) and namespace["cost_model"] == COST
    assert [c["revision"] for c in fake_hub.calls] == ["main", "main"]


def test_standalone_model_card_shows_both_routes_with_a_pinned_revision(tmp_path):
    card = card_for(tmp_path, adapter=False)
    assert 'load_assistant("me/ppow-drafter", revision=revision)' in card
    assert 'from_pretrained("me/ppow-drafter", trust_remote_code=True, revision=revision)' in card
    assert "custom_generate/generate.py" in card and "modeling_ppow_drafter.py" in card and "commit hash" in card


# ------------------------------------------------------------------------------------- the trl version check


@pytest.mark.parametrize("version", ["1.16.0", "1.16.3", "1.16.0rc1", "1.16.1.dev0"])
def test_supported_trl_versions_pass(version, monkeypatch):
    monkeypatch.delenv("PPOW_TRL_SKIP_TRL_CHECK", raising=False)
    check_trl_version(version)


@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0", "0.29.1"])
def test_other_trl_versions_fail_naming_the_range_and_the_fix(version, monkeypatch):
    monkeypatch.delenv("PPOW_TRL_SKIP_TRL_CHECK", raising=False)
    with pytest.raises(ImportError) as error:
        check_trl_version(version)
    message = str(error.value)
    assert SUPPORTED_TRL_RANGE == ">=1.16,<1.17"
    assert f"trl {version} is installed" in message and "trl>=1.16,<1.17" in message
    assert 'pip install "trl>=1.16,<1.17"' in message
    monkeypatch.setenv("PPOW_TRL_SKIP_TRL_CHECK", "1")
    check_trl_version(version)  # the escape hatch


def test_import_ppow_trl_fails_at_once_with_another_trl(tmp_path):
    """`import ppow_trl` with trl's metadata reporting 1.17.0: an ImportError naming both, before trl is imported."""
    code = """
import importlib.metadata, sys
real = importlib.metadata.version
importlib.metadata.version = lambda name: "1.17.0" if name == "trl" else real(name)
try:
    import ppow_trl
except ImportError as error:
    assert "trl" not in sys.modules, "trl was imported before the check"
    print("ERROR:", error)
else:
    print("imported")
"""
    env = {k: v for k, v in os.environ.items() if k != "PPOW_TRL_SKIP_TRL_CHECK"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ERROR:" in result.stdout and "trl 1.17.0 is installed" in result.stdout
    assert 'pip install "trl>=1.16,<1.17"' in result.stdout


# ------------------------------------------------------------------------------ reduced vocabulary drafter


def test_reduced_vocabulary_drafter_through_the_hook(tmp_path, models):
    target, _, close_drafter = models
    draft_vocab = list(range(3, 48))
    drafter = make_drafter(close_drafter, num_layers=1, draft_vocab_ids=draft_vocab)
    assert isinstance(drafter, PPOWDrafterForCausalLM)
    folder = save_assistant(drafter, tmp_path / "d", policy=AdaptiveWindowPolicy(4, 0.0))
    config = json.loads((folder / "config.json").read_text())
    assert (folder / MODELING_FILE).is_file()
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_ppow_drafter.PPOWDrafterForCausalLM"
    assistant = load_assistant(folder)
    assert type(assistant) is PPOWDrafterForCausalLM  # ppow_trl's own class, not the folder's copy
    rounds = spy(assistant)
    for ids in prompts(10):
        assert torch.equal(
            generate(target, ids, assistant_model=assistant, do_sample=False, max_new_tokens=12),
            generate(target, ids, do_sample=False, max_new_tokens=12),
        )
    rounds.clear()
    quiet = copy.deepcopy(target)
    without_eos(quiet, assistant)
    for ids in prompts(3):
        generate(quiet, ids, assistant_model=assistant, do_sample=False, max_new_tokens=12)
    assert rounds and all(len(r["sequence"]) - r["start"] == min(4, r["cap"]) for r in rounds)
    for r in rounds:  # drafted tokens come from the draft vocabulary only
        assert set(r["sequence"][r["start"]:].tolist()) <= set(draft_vocab)


def test_reduced_vocabulary_folder_loads_without_ppow_trl(tmp_path, models):
    """`trust_remote_code=True` alone: the folder's modeling_ppow_drafter.py and custom_generate/generate.py."""
    target, _, close_drafter = models
    drafter = make_drafter(close_drafter, num_layers=1, draft_vocab_ids=list(range(3, 48)))
    save_assistant(drafter, tmp_path / "d", policy=AdaptiveWindowPolicy(4, 1.0))
    target.save_pretrained(tmp_path / "t")
    code = f"""
import sys, functools
sys.modules["ppow_trl"] = None  # `import ppow_trl` raises ImportError
import torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
drafter = AutoModelForCausalLM.from_pretrained({str(tmp_path / "d")!r}, trust_remote_code=True)
target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "t")!r})
assert type(drafter).__name__ == "PPOWDrafterForCausalLM" and "ppow_trl" not in type(drafter).__module__
assert isinstance(drafter.__dict__["generate"], functools.partial)
hook, windows = drafter.generate, []
def spy(*args, **kwargs):
    out = hook(*args, **kwargs)
    windows.append(out.sequences.shape[1] - kwargs["input_ids"].shape[1])
    return out
drafter.generate = spy
ids = torch.tensor([[9, 20, 33, 41, 12]])
kw = dict(attention_mask=torch.ones_like(ids), pad_token_id=0, do_sample=False, max_new_tokens=12)
assert torch.equal(target.generate(ids, assistant_model=drafter, **kw), target.generate(ids, **kw))
assert windows and set(windows) == {{1}}, windows
print("OK")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


# ------------------------------------------------------------------------------------------- bad input


def test_bad_input(tmp_path, models):
    _, drafter, _ = models
    drafter.save_pretrained(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="ppow_window_policy.json"):
        load_assistant(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="not a folder"):
        load_assistant(tmp_path / "missing")
    with pytest.raises(ValueError, match="confidence_temperature"):
        AdaptiveWindowPolicy(4, 0.5, 0.0)
    with pytest.raises(ValueError, match="T_c"):
        hook_module.PPOWWindowCriteria(4, 0.5, confidence_temperature=-1.0)
    with pytest.raises(ValueError, match="AdaptiveWindowPolicy"):
        save_assistant(drafter, tmp_path / "x", policy={"max_window": 4, "threshold": 0.5})
    with pytest.raises(ValueError, match="CostModel"):
        save_assistant(drafter, tmp_path / "x", policy=AdaptiveWindowPolicy(), cost_model={"drafter_cost": 0.1})
    write_assistant_files(tmp_path / "plain", AdaptiveWindowPolicy())
    assert is_ppow_hook(load_assistant(tmp_path / "plain", trust_remote_code=False))

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(drafter), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="merge_and_unload"):
        save_assistant(peft_model, tmp_path / "x", policy=AdaptiveWindowPolicy())
    peft_model.save_pretrained(tmp_path / "adapter")
    write_assistant_files(tmp_path / "adapter", AdaptiveWindowPolicy(), COST)  # what PPOWTrainer._save does
    assert not (tmp_path / "adapter" / "generation_config.json").exists()
    with pytest.raises(ValueError, match="PEFT adapter"):
        load_assistant(tmp_path / "adapter")


def test_the_hook_computes_confidences_over_the_tokenizers_vocabulary(tmp_path, models):
    """A head with padding rows: confidences over the first V scores only, as every other route; save_assistant
    records V from the tokenizer."""
    scores = (torch.tensor([[0.0, 0.0, 0.0, 50.0]]),)  # a padding row would otherwise carry all the mass
    full = hook_module.PPOWWindowCriteria(4, 0.5)
    sliced = hook_module.PPOWWindowCriteria(4, 0.5, vocab_size=3)
    ids = torch.zeros(1, 1, dtype=torch.long)
    assert not bool(full(ids, scores)[0]) and bool(sliced(ids, scores)[0])  # 1.0 >= h keeps; 1/3 < h stops
    target, drafter, _ = models
    folder = save_assistant(copy.deepcopy(drafter), tmp_path / "d", policy=AdaptiveWindowPolicy(4, 0.3),
                            tokenizer=make_tiny_tokenizer())
    assert hook_module.ppow_window_policy(load_assistant(folder))["vocab_size"] == len(make_tiny_tokenizer())
