"""Regression tests for defects found in review: drafter factories leave the caller's global RNG alone."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from ppow_trl.drafters.dflash import dflash_from_target
from ppow_trl.drafters.eagle3 import Eagle3DrafterForCausalLM

LAYERS = [0, 1, 3]


def _dflash(target, seed):
    return dflash_from_target(target, mask_token_id=6, block_size=5, target_layer_ids=LAYERS, num_hidden_layers=2,
                              seed=seed)


def _eagle3(target, seed):
    return Eagle3DrafterForCausalLM.from_target(target, target_layer_ids=LAYERS, num_hidden_layers=2, seed=seed)


@pytest.mark.parametrize("build", [_dflash, _eagle3], ids=["dflash", "eagle3"])
def test_seeded_drafter_leaves_the_global_rng_alone_and_is_deterministic(build):
    target = make_tiny_llama(num_layers=4, seed=0)
    torch.manual_seed(1234)
    torch.rand(3)  # somewhere in the caller's stream, not at a fresh seed
    state = torch.get_rng_state()
    first = build(target, 0).state_dict()
    assert torch.equal(torch.get_rng_state(), state)  # the caller's next random numbers are what they were
    second, other = build(target, 0).state_dict(), build(target, 1).state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)  # same seed, same weights
    assert any(not torch.equal(first[key], other[key]) for key in first)  # the seed does set the random weights
    # ... whatever the caller's stream was before.
    torch.manual_seed(99)
    assert all(torch.equal(first[key], value) for key, value in build(target, 0).state_dict().items())


@pytest.mark.parametrize("build", [_dflash, _eagle3], ids=["dflash", "eagle3"])
def test_unseeded_drafter_draws_from_the_global_rng(build):
    """seed=None keeps using (and advancing) the caller's stream: two unseeded drafters differ."""
    target = make_tiny_llama(num_layers=4, seed=0)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    first, second = build(target, None).state_dict(), build(target, None).state_dict()
    assert not torch.equal(torch.get_rng_state(), state)
    assert any(not torch.equal(first[key], second[key]) for key in first)


def test_import_does_not_print_bitsandbytes_missing_kernels_warning():
    """bitsandbytes' CPU backend logs a warning at import when its optional Hub kernel cannot be used (the `kernels`
    package missing, the Hub offline, the repository not on the trust allowlist; every run printed one): `import
    ppow_trl` drops exactly those records, and the logger's other warnings still show."""
    import subprocess
    import sys
    from pathlib import Path

    template = ("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already "
                "`pip install kernels` and the kernels >= 0.11.1")
    code = "\n".join([
        "import logging",
        "import ppow_trl",
        "import bitsandbytes  # its CPU backend tries `kernels` at import (on CPUs with AVX512-BF16)",
        "log = logging.getLogger('bitsandbytes.backends.cpu.ops')",
        # The record bitsandbytes logs, sent by hand too, so that the check holds on CPUs that skip that branch.
        f"log.warning({template!r}, ModuleNotFoundError(\"No module named 'kernels'\"))",
        # `kernels` installed (the lock pins it) but the Hub offline, or the repository not on the trust allowlist:
        # bitsandbytes falls back to its own kernel, nothing to say. Any other failure still shows.
        f"log.warning({template!r}, RuntimeError(\"Version 1 of 'kernels-community/quantization-bitsandbytes' is "
        "not available in the local cache and Hugging Face Hub is in offline mode\"))",
        f"log.warning({template!r}, RuntimeError(\"Kernel repository 'kernels-community/quantization-bitsandbytes' "
        "could not verify publisher trust status. Set trust_remote_code=True\"))",
        f"log.warning({template!r}, RuntimeError('the kernel build is broken'))",
        "log.warning('another bitsandbytes warning')",
    ])
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "No module named 'kernels'" not in run.stderr, run.stderr
    assert "offline mode" not in run.stderr and "trust_remote_code" not in run.stderr, run.stderr
    assert "kernels-community: the kernel build is broken" in run.stderr and "another bitsandbytes warning" in run.stderr


def test_dflash_loss_refuses_a_window_token_outside_the_shared_vocabulary():
    """The block loss used to clamp such labels silently (scoring another token); it now raises like every family."""
    from ppow_trl.drafters.dflash import dflash_from_target
    from ppow_trl.drafting import family_of
    from ppow_trl.features import context_features
    from ppow_trl.training.window_logprobs import window_logprobs

    target = make_tiny_llama(num_layers=4, seed=0)
    drafter = dflash_from_target(target, mask_token_id=6, block_size=5, target_layer_ids=[0, 1, 3])
    family = family_of(drafter)
    layers = family.target_layer_ids(drafter)
    ids = torch.tensor([[9, 10, 11, 12, 20, 63]])  # context of 4, window (20, 63)
    mask = torch.ones_like(ids)

    def features(contexts):
        return context_features(target, contexts, layers)

    ok, _ = window_logprobs(drafter, family, ids, mask, 2, vocab_size=64, temperature=1.0, target=target,
                            context_features=features)
    assert ok.shape == (1, 2) and torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="outside the drafter's vocabulary"):
        window_logprobs(drafter, family, ids, mask, 2, vocab_size=40, temperature=1.0, target=target,
                        context_features=features)


def test_dflash_drafters_are_recognised_from_hub_ids(tmp_path, monkeypatch):
    """load_assistant's family detection reads a Hub repo's config.json (it used to look at local folders only)."""
    import huggingface_hub

    from ppow_trl.drafters.dflash import dflash_from_target
    from ppow_trl.drafting import detect_family, get_family

    target = make_tiny_llama(num_layers=4, seed=0)
    dflash_from_target(target, mask_token_id=6, block_size=5, target_layer_ids=[0, 1, 3]).save_pretrained(tmp_path)
    served = []

    def fake_download(repo_id, filename, **kwargs):
        served.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    family, layout = detect_family("someone/dflash-drafter", revision="abc")
    assert family is get_family("dflash") and layout == "transformers" and served[0] == ("someone/dflash-drafter",
                                                                                        "config.json")
