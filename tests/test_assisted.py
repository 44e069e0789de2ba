"""HF assisted generation with a saved PPOW drafter: `target.generate(..., assistant_model=load_assistant(folder))`.

Checks: the folder carries the policy; greedy output equals the target's own greedy output (EOS inside
windows included); the adaptive rule decides how many tokens each round drafts (a spy on the drafter's
`generate`, which HF's loop calls once per round); sampling keeps the target's distribution; the
reduced-vocabulary drafter works through the same hook (with and without ppow_trl importable); bad input.
"""

import copy
import functools
import json
import subprocess
import sys

import pytest
import torch
from scipy.stats import chisquare

from conftest import easy_hard_bigram_table, make_bigram_llama, make_tiny_llama, make_tiny_tokenizer
from ppow_trl.assisted import (
    CUSTOM_GENERATE_FILE,
    GENERATION_CONFIG_KEY,
    MODELING_FILE,
    attach_window_policy,
    load_assistant,
    load_cost_model,
    save_assistant,
    write_assistant_files,
)
from ppow_trl.cost import CostModel
from ppow_trl.drafter import PPOWDrafterForCausalLM
from ppow_trl.models import make_drafter
from ppow_trl.windowing import WINDOW_POLICY_FILE, AdaptiveWindowPolicy

EOS = 3  # make_tiny_llama's eos_token_id
COST = CostModel(drafter_cost=0.2, verify_cost=[1.0, 1.1, 1.2], description="test")


def make_models(seed=0):
    """A non-degenerate target, a random drafter (often wrong) and a noisy copy of the target (often right)."""
    target = make_tiny_llama(num_layers=2, seed=seed, initializer_range=0.5)
    random_drafter = make_tiny_llama(num_layers=1, seed=seed + 1, initializer_range=0.5)
    close_drafter = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter in close_drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * 0.02)
    return target, random_drafter, close_drafter


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


def saved_and_loaded(drafter, folder, max_window, threshold):
    """``load_assistant(save_assistant(copy of drafter, folder, policy=AdaptiveWindowPolicy(K, h)))``."""
    policy = AdaptiveWindowPolicy(max_window, threshold)
    return load_assistant(save_assistant(copy.deepcopy(drafter), folder, policy=policy))


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


def teacher_forced_confidences(drafter, sequence, start, temperature=1.0):
    """``max softmax(logits / T)`` of the drafter for each drafted token ``sequence[start:]``, from one forward."""
    with torch.no_grad():
        logits = drafter(sequence[None]).logits[0, start - 1 : len(sequence) - 1].float()
    return torch.softmax(logits / temperature, dim=-1).amax(dim=-1)


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
    assert saved[GENERATION_CONFIG_KEY] == {"max_window": 5, "threshold": 0.35}
    assert saved["eos_token_id"] == EOS  # the model's own generation settings are kept
    assert drafter.generation_config.num_assistant_tokens == 5  # the in-memory drafter is set too
    # the hook file is self-contained: it must run where ppow_trl is not installed
    assert "ppow_trl" not in "".join(
        line for line in (folder / CUSTOM_GENERATE_FILE).read_text().splitlines() if line.startswith(("import", "from"))
    )

    loaded = load_assistant(folder)
    assert isinstance(loaded.__dict__["generate"], functools.partial)  # transformers installed the folder's hook
    assert AdaptiveWindowPolicy.from_pretrained(folder) == policy
    assert getattr(loaded.generation_config, GENERATION_CONFIG_KEY) == {"max_window": 5, "threshold": 0.35}
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


@pytest.mark.parametrize("do_sample,temperature", [(False, 1.0), (True, 0.7)])
@pytest.mark.parametrize("max_window,threshold", [(5, 0.3), (6, 0.15), (4, 0.5)])
def test_each_round_drafts_the_policys_window_length(tmp_path, models, do_sample, temperature, max_window, threshold):
    """Window lengths equal `policy.window_lengths` of the drafter's own confidences, recomputed independently:
    ``max softmax(logits / T)`` from a teacher-forced forward (T = 1 greedy, the sampling temperature otherwise)."""
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
    lengths = []
    for r in rounds:
        drafted = len(r["sequence"]) - r["start"]
        confidences = teacher_forced_confidences(drafter, r["sequence"], r["start"], temperature)
        recorded = torch.stack([torch.softmax(s[0].float(), -1).max() for s in r["scores"]])
        torch.testing.assert_close(recorded, confidences, atol=1e-5, rtol=1e-5)
        assert drafted == expected_length(policy, confidences, r["cap"]), r
        lengths.append(drafted)
    assert len(set(lengths)) >= 3  # the rule really varies the windows here


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
    with pytest.raises(ValueError, match="AdaptiveWindowPolicy"):
        save_assistant(drafter, tmp_path / "x", policy={"max_window": 4, "threshold": 0.5})
    with pytest.raises(ValueError, match="CostModel"):
        save_assistant(drafter, tmp_path / "x", policy=AdaptiveWindowPolicy(), cost_model={"drafter_cost": 0.1})
    write_assistant_files(tmp_path / "plain", AdaptiveWindowPolicy())
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_assistant(tmp_path / "plain", trust_remote_code=False)

    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(drafter), LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="merge_and_unload"):
        save_assistant(peft_model, tmp_path / "x", policy=AdaptiveWindowPolicy())
    peft_model.save_pretrained(tmp_path / "adapter")
    write_assistant_files(tmp_path / "adapter", AdaptiveWindowPolicy(), COST)  # what PPOWTrainer._save does
    assert not (tmp_path / "adapter" / "generation_config.json").exists()
    with pytest.raises(ValueError, match="PEFT adapter"):
        load_assistant(tmp_path / "adapter")
