"""Right on GPUs: load_target's CUDA defaults, device checks, and the core paths on each device.

Tests taking the `device` fixture (tests/conftest.py) run on `cpu` here and also on `cuda` where one
exists (`pytest -m cuda tests/test_cuda.py` runs only the CUDA half: what benchmarks/gpu_check.py does).
The load_target tests build CUDA arguments on CPU: `from_pretrained` is replaced by a stub that records
its keyword arguments, and `torch.cuda.is_available` by one returning True; nothing loads on a GPU.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_llama

import ppow_trl.models as models
from ppow_trl import calibrate_cost_model, speculative_generate
from ppow_trl.models import check_same_device, load_target, model_device
from ppow_trl.core.rollout import draft_windows, target_window_probs
from ppow_trl.core.verification import acceptance_probabilities, expected_accepted_length
from ppow_trl.core.windowing import AdaptiveWindowPolicy

EOS = 3  # make_tiny_llama's eos_token_id
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- load_target arguments


@pytest.fixture
def captured(monkeypatch, tmp_path):
    """Stub `from_pretrained` (records kwargs, returns a tiny model); returns (kwargs list, model folder)."""
    calls = []

    def from_pretrained(source, **kwargs):
        calls.append(kwargs)
        return make_tiny_llama()

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return calls, str(tmp_path)  # an existing folder: no Hub lookup


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(models, "local_process_index", lambda: 1)  # process 1 of a multi-GPU launch


def test_load_target_cpu_defaults_unchanged(captured):
    calls, folder = captured
    target = load_target(folder)
    assert calls[-1] == {}  # checkpoint dtype ("auto"), no device_map: as before
    assert not target.training and not any(p.requires_grad for p in target.parameters())

    load_target(folder, quantization="4bit")
    config = calls[-1]["quantization_config"]
    assert set(calls[-1]) == {"quantization_config"}
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.float32  # bf16 matmuls are very slow on CPU


def test_load_target_cuda_defaults(captured, fake_cuda):
    calls, folder = captured
    load_target(folder)
    assert calls[-1] == {"dtype": torch.bfloat16, "device_map": {"": 1}}

    load_target(folder, quantization="4bit")
    kwargs = calls[-1]
    assert kwargs["dtype"] == torch.bfloat16 and kwargs["device_map"] == {"": 1}
    config = kwargs["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_compute_dtype == torch.bfloat16

    load_target(folder, quantization="8bit")
    assert calls[-1]["quantization_config"].load_in_8bit and calls[-1]["device_map"] == {"": 1}


def test_load_target_explicit_arguments_win(captured, fake_cuda):
    calls, folder = captured
    load_target(folder, dtype=torch.float16, device_map="auto")
    assert calls[-1] == {"dtype": torch.float16, "device_map": "auto"}

    load_target(folder, quantization="4bit", torch_dtype="float32", bnb_4bit_quant_type="fp4")
    config = calls[-1]["quantization_config"]
    assert calls[-1]["dtype"] == "float32" and calls[-1]["device_map"] == {"": 1}
    assert config.bnb_4bit_compute_dtype == torch.float32 and config.bnb_4bit_quant_type == "fp4"

    with pytest.raises(ValueError, match="not both"):
        load_target(folder, dtype=torch.float16, torch_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="either `quantization` or `quantization_config`"):
        load_target(folder, quantization="4bit", quantization_config=object())
    with pytest.raises(ValueError, match="4bit"):
        load_target(folder, quantization="3bit")


def test_load_target_cuda_keeps_clear_errors(fake_cuda, tmp_path):
    with pytest.raises(FileNotFoundError, match="No model folder"):
        load_target(str(tmp_path / "missing"))


def test_local_process_index(monkeypatch):
    import accelerate

    class State:
        local_process_index = 3

    monkeypatch.setattr(accelerate, "PartialState", State)
    assert models.local_process_index() == 3
    monkeypatch.setitem(sys.modules, "accelerate", None)  # `from accelerate import ...` raises ImportError
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert models.local_process_index() == 2


# ----------------------------------------------------------------------------- device helpers


def test_model_device_and_check_same_device(tiny_target, tiny_drafter):
    assert model_device(tiny_target) == torch.device("cpu")
    assert check_same_device(tiny_target, tiny_drafter) == torch.device("cpu")
    elsewhere = copy.deepcopy(tiny_drafter).to("meta")  # stands in for "another device" on a CPU machine
    with pytest.raises(ValueError, match=r"target is on cpu but the drafter is on meta.*\.to\(target\.device\).*device_map"):
        check_same_device(tiny_target, elsewhere)
    with pytest.raises(ValueError, match="no parameters"):
        model_device(torch.nn.Module())


def test_make_drafter_pretrained_follows_target_device(tiny_target, tiny_drafter, tiny_tokenizer, tmp_path):
    tiny_drafter.save_pretrained(tmp_path)
    target = copy.deepcopy(tiny_target).to("meta")  # a target on "another device" than the CPU-loaded drafter
    drafter = models.make_drafter(target, pretrained=tmp_path, target_tokenizer=tiny_tokenizer)
    assert model_device(drafter).type == "meta" and check_same_device(target, drafter).type == "meta"


# ----------------------------------------------------------------------------- device-parametrised paths


def make_pair(device, seed=0):
    """Target with peaked, context-dependent distributions and a drafter that is a noisy copy of it."""
    target = make_tiny_llama(num_layers=2, seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    drafter = copy.deepcopy(target)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * 0.005)
    return target.to(device), drafter.to(device)


def test_greedy_speculative_generate_matches_generate(device):
    target, drafter = make_pair(device)
    policy = AdaptiveWindowPolicy(max_window=4, threshold=0.3)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for _ in range(6):
        prompt = torch.randint(8, 64, (1, int(torch.randint(1, 9, (1,), generator=g))), generator=g).to(device)
        out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=12, eos_token_id=EOS)
        expected = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
        assert out.new_tokens == expected[0, prompt.shape[1]:].tolist()
        assert out.sequences.device == prompt.device
        accepted += sum(out.accepted_per_round)
    assert accepted > 0  # the drafter's tokens were really used


def test_draft_windows_on_device(device):
    target, drafter = make_pair(device)
    policy = AdaptiveWindowPolicy(max_window=5, threshold=0.2)
    contexts = [torch.tensor([9, 10, 11, 12]), torch.tensor([20, 21])]
    generator = torch.Generator(device).manual_seed(0)
    windows = draft_windows(drafter, contexts, policy, generator=generator, num_samples_per_context=4)

    assert windows.window_ids.shape[0] == 8 and windows.window_ids.shape[1] <= 5
    for tensor in (windows.window_ids, windows.drafter_probs, windows.window_mask):
        assert tensor.device.type == device.type
    log_probs = windows.drafter_probs.gather(-1, windows.window_ids.unsqueeze(-1)).squeeze(-1).log()
    assert torch.isfinite(log_probs).all()  # sampled tokens had positive probability
    assert windows.window_mask.any()

    p = target_window_probs(target, contexts, windows.window_ids, num_samples_per_context=4)
    assert p.device.type == device.type and p.shape[:2] == (8, windows.window_ids.shape[1] + 1)
    alpha = acceptance_probabilities(windows.window_ids, p, windows.drafter_probs, windows.window_mask)
    assert torch.isfinite(expected_accepted_length(alpha, windows.window_mask)).all()


def test_calibrate_cost_model_on_device(device):
    target = make_tiny_llama(num_layers=3, hidden_size=64).to(device)
    drafter = make_tiny_llama(num_layers=1).to(device)
    seen = set()
    hooks = [m.register_forward_pre_hook(lambda _m, args, kwargs: seen.add(_input_device(args, kwargs)), with_kwargs=True)
             for m in (target, drafter)]
    try:
        cost = calibrate_cost_model(target, drafter, max_window=3, context_length=16, repeats=3, warmup=1)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen == {device.type}
    assert len(cost.verify_cost) == 4 and cost.verify_cost[0] == 1.0
    assert all(math.isfinite(c) and c > 0 for c in cost.verify_cost) and cost.drafter_cost > 0
    assert f" {device.type} " in cost.description


def _input_device(args, kwargs) -> str:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids.device.type


def test_bf16_target_fp32_drafter(device):
    if device.type == "cpu":
        pytest.skip("bf16 matmuls are very slow on the development CPUs; this combination is for GPUs")
    target, drafter = make_pair(device)
    target = target.to(torch.bfloat16)
    policy = AdaptiveWindowPolicy(max_window=4, threshold=0.0)
    prompt = torch.tensor([[9, 10, 11]], device=device)
    # bf16 verification over L + 1 tokens and bf16 one-token steps may round differently, so greedy output is
    # not compared with target.generate here (the fp32 test above checks losslessness); it must run and count right.
    out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=16, eos_token_id=[])
    assert len(out.new_tokens) == 16 and sum(out.tokens_per_round) == 16
    assert all(0 <= token < 64 for token in out.new_tokens) and out.tau >= 1
    sampled = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=16, eos_token_id=[],
                                   do_sample=True, generator=torch.Generator(device).manual_seed(0))
    assert len(sampled.new_tokens) == 16


def test_load_target_on_device(device, tmp_path):
    """Real loads (no stubs): CPU keeps the checkpoint's fp32; CUDA gets bf16 on the local GPU, and 4-bit there."""
    make_tiny_llama().save_pretrained(tmp_path)
    target = load_target(str(tmp_path))
    if device.type == "cpu":
        assert model_device(target).type == "cpu" and target.dtype == torch.float32
        return
    assert model_device(target) == torch.device("cuda", models.local_process_index()) and target.dtype == torch.bfloat16
    pytest.importorskip("bitsandbytes")
    quantized = load_target(str(tmp_path), quantization="4bit")
    assert type(quantized.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert quantized.model.layers[0].self_attn.q_proj.compute_dtype == torch.bfloat16
    assert model_device(quantized).type == "cuda"
    with torch.no_grad():
        assert torch.isfinite(quantized(torch.tensor([[9, 10, 11]], device=model_device(quantized))).logits).all()


# ----------------------------------------------------------------------------- benchmarks/gpu_check.py


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_tiny(tmp_path):
    out = tmp_path / "gpu_tiny.json"
    _gpu_check().main(["--tiny", "--out", str(out)])
    result = json.loads(out.read_text())

    assert result["tiny"] and result["cuda_tests"] == {"skipped": "--tiny"}
    assert result["versions"]["torch"] == torch.__version__ and result["command"].startswith("python benchmarks/gpu_check.py")
    (profile,) = result["profiles"]
    assert profile["L"] == list(range(9)) and len(profile["t_v_over_t_t"]) == 9
    assert profile["t_v_over_t_t"][0] == 1.0 and all(c > 0 for c in profile["t_v_over_t_t"])
    assert profile["t_d_over_t_t"] > 0 and profile["t_t_s"] > 0
    assisted = profile["assisted_overhead"]["assisted"]
    assert assisted["target_forwards"] > 0 and assisted["drafter_forwards"] > 0
    assert "overhead_per_round_s" in assisted and "overhead_over_t_t" in assisted
