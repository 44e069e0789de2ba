"""Every drafter family against the same contract (``ppow_trl.drafting``): found by its family, saved, loaded and
exported without changing what it drafts, lossless in our loop and in ``target.generate(assistant_model=...)``, exact
greedy tau equal to the live loop, batched rollouts equal to one context at a time, the loss's log-probs equal to the
sampled ones, and a cost model charging the family's unit. Family-specific behaviour stays in test_eagle3.py,
test_dflash.py and test_prompt_lookup.py."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama, make_tiny_tokenizer, tiny_word_responses
from transformers import set_seed

from ppow_trl.serving.assisted import load_assistant, save_assistant
from ppow_trl.core.cost import calibrate_cost_model
from ppow_trl.data import compute_target_topk
from ppow_trl.drafting import detect_family, drafting_session, family_names, family_of, get_family, load_drafter
from ppow_trl.features import context_features
from ppow_trl.serving.generation import exact_greedy_tau, speculative_generate
from ppow_trl.training.kd_trainer import KDConfig, KDTrainer
from ppow_trl.core.rollout import draft_windows
from ppow_trl.core.windowing import AdaptiveWindowPolicy

# How each family's drafter is built for the tiny 4-layer target, and how long KD trains it (0: not trained). A family
# registered later without an entry is built with its defaults.
BUILD = {
    "standalone": ({"num_layers": 1}, {"max_steps": 60}),
    "eagle3": ({"target_layer_ids": [1, 2, 4]}, {"max_steps": 60, "ttt_steps": 3}),
    "dflash": ({"mask_token_id": 6, "block_size": 5, "target_layer_ids": [0, 1, 3]},
               {"max_steps": 200, "block_anchors": 8}),
    # over the KD-trained standalone drafter, so that windows mix looked-up and drafted tokens
    "hybrid": (lambda data, factory: {"drafter": drafter_of("standalone", data, factory)}, {}),
}
TRAINABLE = [name for name in family_names() if get_family(name).trainable]
EXPORTS = [(name, layout) for name in family_names() for layout in get_family(name).export_formats]


@pytest.fixture(scope="module")
def data():
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_llama(num_layers=4, seed=0, initializer_range=0.5)
    responses = tiny_word_responses(target, tokenizer)
    return {"tokenizer": tokenizer, "target": target, "responses": responses,
            "topk": compute_target_topk(target, responses, top_k=8)}


_DRAFTERS: dict = {}


def drafter_of(name: str, data, tmp_path_factory):
    """The family's drafter for the tiny target, KD-trained once per module where the family trains."""
    if name not in _DRAFTERS:
        family = get_family(name)
        options, kd = BUILD.get(name, ({}, {}))
        options = options(data, tmp_path_factory) if callable(options) else options
        set_seed(0)
        drafter = family.build(data["target"], data["tokenizer"], **options)
        if family.trainable and kd.get("max_steps"):
            args = KDConfig(output_dir=str(tmp_path_factory.mktemp(f"kd-{name}")), per_device_train_batch_size=8,
                            learning_rate=1e-2, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
                            logging_steps=50, **kd)
            KDTrainer(drafter.train(), args, train_dataset=data["topk"], processing_class=data["tokenizer"],
                      target=data["target"]).train()
        _DRAFTERS[name] = drafter.eval()
    return _DRAFTERS[name]


@pytest.fixture(params=family_names())
def case(request, data, tmp_path_factory):
    name = request.param
    return {**data, "name": name, "family": get_family(name), "drafter": drafter_of(name, data, tmp_path_factory)}


def _teacher_forced(drafter, target, prompt: list[int], text: list[int], max_window: int = 3) -> torch.Tensor:
    """Every slot of windows after every prefix of ``text`` (what exact greedy tau reads), stacked."""
    session = drafting_session(drafter, target)
    layer_ids = session.target_layer_ids
    features = None
    if layer_ids is not None:
        features = context_features(target, [torch.tensor(prompt + text)], layer_ids)[0]
    with torch.no_grad():
        return torch.stack([logits for _, logits in session.teacher_forced_logits(prompt, text, max_window, features)])


def _prompt_and_text(data, index: int = 0) -> tuple[list[int], list[int]]:
    return list(data["responses"]["prompt_ids"][index]), list(data["responses"]["response_ids"][index])


def test_family_recognises_its_drafter_and_folder(case, tmp_path):
    family, drafter = case["family"], case["drafter"]
    assert family_of(drafter) is family
    save_assistant(drafter, tmp_path / "saved", policy=AdaptiveWindowPolicy(3, 0.2), tokenizer=case["tokenizer"])
    found, layout = detect_family(tmp_path / "saved")
    assert found is family and layout
    hook = (tmp_path / "saved" / "custom_generate" / "generate.py").is_file()
    assert hook == family.writes_hook_file  # a family with its own transformers route gets no hook file


def test_save_load_round_trip_drafts_the_same(case, tmp_path):
    target, drafter = case["target"], case["drafter"]
    save_assistant(drafter, tmp_path / "saved", policy=AdaptiveWindowPolicy(3, 0.2), tokenizer=case["tokenizer"])
    loaded = load_drafter(tmp_path / "saved", target=target).eval()
    assert type(loaded) is type(drafter)
    prompt, text = _prompt_and_text(case)
    torch.testing.assert_close(_teacher_forced(loaded, target, prompt, text),
                               _teacher_forced(drafter, target, prompt, text), atol=1e-5, rtol=1e-4)
    if case["family"].trainable:  # loaded to be trained further, as after build
        assert any(p.requires_grad for p in loaded.parameters())


@pytest.mark.parametrize("name,layout", EXPORTS)
def test_export_round_trip_drafts_the_same(name, layout, data, tmp_path, tmp_path_factory):
    family, target = get_family(name), data["target"]
    drafter = drafter_of(name, data, tmp_path_factory)
    family.export(drafter, tmp_path / layout, format=layout, target=target)
    assert detect_family(tmp_path / layout) == (family, layout)
    back = load_drafter(tmp_path / layout, target=target).eval()
    prompt, text = _prompt_and_text(data, 1)
    torch.testing.assert_close(_teacher_forced(back, target, prompt, text),
                               _teacher_forced(drafter, target, prompt, text), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="does not apply"):
        family.export(drafter, tmp_path / "bad", format="no-such-layout", target=target)


@pytest.mark.parametrize("max_window,threshold", [(4, 0.0), (3, 0.4)])
def test_greedy_is_lossless_and_exact_tau_equals_the_loop(case, max_window, threshold):
    target, drafter = case["target"], case["drafter"]
    policy = AdaptiveWindowPolicy(max_window=max_window, threshold=threshold)
    accepted = 0
    for prompt in case["responses"]["prompt_ids"][:6]:
        prompt = torch.tensor([prompt])
        reference = target.generate(prompt, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
        out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=16, eos_token_id=[])
        assert torch.equal(out.sequences[0], reference[0])
        exact = exact_greedy_tau(target, drafter, prompt, policy=policy, max_new_tokens=16, eos_token_id=[])
        assert exact.accepted_per_round == out.accepted_per_round
        accepted += sum(out.accepted_per_round)
        rounds = sum(1 for d in out.drafted_per_round if d)
        unit = rounds if case["family"].cost_per_round else sum(out.drafted_per_round)
        assert out.drafter_forwards >= unit  # the session counts what the cost model charges
    if case["family"].trainable:
        assert accepted > 10  # the trained drafter is accepted: state hand-offs are exercised


def test_hf_route_is_lossless(case, tmp_path):
    """``target.generate(assistant_model=load_assistant(folder, target=target))``, the family's route, reproduces
    plain greedy decoding."""
    target, family = case["target"], case["family"]
    save_assistant(case["drafter"], tmp_path / "saved", policy=AdaptiveWindowPolicy(3, 0.2),
                   tokenizer=case["tokenizer"])
    assistant = load_assistant(tmp_path / "saved", target=target)
    try:
        for prompt in case["responses"]["prompt_ids"][:3]:
            prompt = torch.tensor([prompt])
            plain = target.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
            out = target.generate(prompt, assistant_model=assistant, do_sample=False, max_new_tokens=12,
                                  pad_token_id=0, eos_token_id=None, **family.hf_generate_kwargs)
            assert torch.equal(out, plain)
    finally:
        family.detach(assistant)


def test_batched_rollout_equals_one_context_at_a_time(case):
    target, drafter, data = case["target"], case["drafter"], case["responses"]
    contexts = [torch.tensor(p + r[:k])
                for p, r, k in zip(data["prompt_ids"][:4], data["response_ids"][:4], (0, 3, 5, 1))]
    policy = AdaptiveWindowPolicy(3, 0.0)
    batch = draft_windows(drafter, contexts, policy, temperature=0.0, target=target, num_samples_per_context=2)
    for index, context in enumerate(contexts):
        alone = draft_windows(drafter, [context], policy, temperature=0.0, target=target)
        for row in (2 * index, 2 * index + 1):
            assert torch.equal(batch.window_ids[row], alone.window_ids[0])
            torch.testing.assert_close(batch.drafter_probs[row], alone.drafter_probs[0], atol=1e-5, rtol=1e-4)
    if case["family"].reads_target:  # refused at once, saying what is missing
        with pytest.raises(ValueError, match="target="):
            draft_windows(drafter, contexts, policy)


def test_cost_model_charges_the_family_unit(case):
    cost = calibrate_cost_model(case["target"], case["drafter"], 3, repeats=2, warmup=1, context_length=16)
    assert cost.drafter_per_round == case["family"].cost_per_round and cost.drafter_cost > 0
    assert cost.raw_seconds["drafter_step"] > 0 and "median of 2" in cost.description


@pytest.mark.parametrize("name", TRAINABLE)
def test_loss_log_probs_equal_the_sampled_ones(name, data, tmp_path, tmp_path_factory, monkeypatch):
    """The PPOW loss's log q (the family's ``window_hidden`` through its head, each context once) equals the
    rollout's sampled log q, and its gradient reaches the drafter. Rollouts draft in eval mode (as served) and the
    trainer's folder gets the hook file only where the family's route uses one."""
    import copy

    import ppow_trl.training.ppow_trainer as trainer_module
    from ppow_trl.training.ppow_config import PPOWConfig
    from ppow_trl.training.ppow_trainer import PPOWTrainer

    modes = []
    verify = trainer_module.verify_windows
    def recording(target, drafter, *args, **kwargs):
        modes.append(drafter.training)
        return verify(target, drafter, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "verify_windows", recording)

    drafter = copy.deepcopy(drafter_of(name, data, tmp_path_factory)).train()
    args = PPOWConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_window=3,
                      max_steps=1, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
                      disable_tqdm=True, selection_refresh_steps=5, seed=0, drafter_cost=0.3,
                      verify_cost=[1.0, 1.4, 1.6, 1.8])
    trainer = PPOWTrainer(model=drafter, target_model=data["target"], args=args, train_dataset=data["responses"],
                          processing_class=data["tokenizer"])
    trainer.model.train()
    out = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in [0, 0, 0, 0, 5, 5, 5, 5]])
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, out["completion_ids"].shape[1])
    rewards = trainer.last_window_rewards
    valid = rewards["window_mask"]
    assert valid.sum() >= 8
    assert torch.allclose(logps[valid], rewards["sampled_logq"][valid], atol=1e-4), \
        (logps - rewards["sampled_logq"]).abs().max()
    assert modes == [False] and trainer.model.training  # drafted in eval mode, trained in train mode
    logps.sum().backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad]
    assert grads and all(g is None or torch.isfinite(g).all() for g in grads)
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "custom_generate" / "generate.py").is_file() == get_family(name).writes_hook_file
    assert (tmp_path / "saved" / "ppow_window_policy.json").is_file()


def test_untrainable_families_are_refused_by_the_trainers(data):
    for name in family_names():
        family = get_family(name)
        if family.trainable:
            continue
        drafter = family.build(data["target"], data["tokenizer"])
        with pytest.raises(ValueError, match="no parameters"):
            KDTrainer(drafter, KDConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True),
                      train_dataset=data["topk"], processing_class=data["tokenizer"], target=data["target"])


def test_empty_windows_are_lossless_and_hand_the_guard_what_exact_tau_replays(case, monkeypatch):
    """Rules whose rounds draft nothing when the first confidence is under ``h``, guarded: lossless on every family,
    exact tau equals the loop, and at K = 1 (where the replay's windows are the served ones) the loop hands the guard
    the same ``(A, L, F, D)`` as the replay, with ``D = 1`` for each empty round (its drafter step ran). The hybrid's
    dropped first token may be a lookup (no drafter step), which the replay charges as drafted: left out there."""
    from ppow_trl.core.custom_generate.generate import SpeculationGuard

    target, drafter = case["target"], case["drafter"]
    guard = {"break_even_tokens": 1.2, "loss_budget": 3.0, "probe_every": 4, "max_pause": 16,
             "round_costs": [1.0, 1.2], "free_token_saving": 0.1}
    policy = AdaptiveWindowPolicy(max_window=1, threshold=0.5, empty_windows=True, guard=guard)
    calls, record = [], SpeculationGuard.record

    def spy(self, accepted, drafted=None, free=0, dropped=0):
        calls.append((int(accepted), drafted, int(free), int(dropped)))
        return record(self, accepted, drafted, free, dropped)

    monkeypatch.setattr(SpeculationGuard, "record", spy)
    empty = 0
    for prompt in case["responses"]["prompt_ids"][:6]:
        prompt = torch.tensor([prompt])
        reference = target.generate(prompt, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
        calls.clear()
        out = speculative_generate(target, drafter, prompt, policy=policy.with_window(1, 0.5), max_new_tokens=16,
                                   eos_token_id=[])
        served = list(calls)
        assert torch.equal(out.sequences[0], reference[0])
        calls.clear()
        exact = exact_greedy_tau(target, drafter, prompt, policy=policy, max_new_tokens=16, eos_token_id=[])
        assert exact.accepted_per_round == out.accepted_per_round
        empty += sum(1 for length in out.drafted_per_round if length == 0)
        if case["name"] != "hybrid":
            assert served == calls
            assert all(d == int(length == 0) for _, length, _, d in served)
    assert empty > 0  # the rule did draft nothing in some rounds
