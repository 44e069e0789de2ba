"""Contract tests of ``ppow_trl.training._trl_compat``: every TRL (and transformers-Trainer) internal ppow_trl relies on.

One test per touch point: after a TRL upgrade the failing tests name what changed (a missing name, a changed
signature, a changed behaviour) and the supported range. Plus: the chunked log-prob wrapper against a brute-force
log-softmax, the tables in sync with the trainers' overrides, and the checker reporting injected changes.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ppow_trl.training import _trl_compat as compat
from ppow_trl.training._trl_compat import (
    CALLED_METHODS,
    GRPO_CONFIG_FIELDS,
    IMPORTED_NAMES,
    OVERRIDDEN_METHODS,
    PRIVATE_ATTRIBUTES,
    SOURCE_CONTRACTS,
    check_touch_point,
    check_trl_contracts,
    chunked_logprobs,
)

PIP = 'pip install "trl>=1.16,<1.17"'


def assert_holds(key: str) -> None:
    problems = check_touch_point(key)
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ one test per touch point


@pytest.mark.parametrize("name", list(IMPORTED_NAMES))
def test_imported_name(name):
    assert_holds(name)


@pytest.mark.parametrize("method", list(OVERRIDDEN_METHODS))
def test_overridden_method(method):
    assert_holds(method)


@pytest.mark.parametrize("method", list(CALLED_METHODS))
def test_called_method(method):
    assert_holds(method)


@pytest.mark.parametrize("attribute", list(PRIVATE_ATTRIBUTES))
def test_private_attribute(attribute):
    assert_holds(attribute)


@pytest.mark.parametrize("field", list(GRPO_CONFIG_FIELDS))
def test_grpo_config_field(field):
    assert_holds(f"GRPOConfig.{field}")


@pytest.mark.parametrize("where, snippet, why", SOURCE_CONTRACTS, ids=[f"{w}:{s[:40]}" for w, s, _ in SOURCE_CONTRACTS])
def test_source_contract(where, snippet, why):
    assert_holds(f"{where}: {snippet}")


def test_check_trl_contracts_is_empty_on_the_installed_trl():
    problems = check_trl_contracts()
    assert problems == [], "\n".join(problems)


def test_touch_points_cover_every_table_once():
    keys = compat.touch_points()
    assert len(keys) == len(set(keys))
    assert len(keys) == (len(IMPORTED_NAMES) + len(OVERRIDDEN_METHODS) + len(CALLED_METHODS)
                         + len(PRIVATE_ATTRIBUTES) + len(GRPO_CONFIG_FIELDS) + len(SOURCE_CONTRACTS))
    with pytest.raises(KeyError, match="not a touch point"):
        check_touch_point("GRPOTrainer.no_such_thing")


# ------------------------------------------------------------------ re-exports and the kernel wrapper


def test_reexports_are_trls_objects():
    import trl.trainer.utils as trl_utils
    from trl.kernels import ChunkedLogProbFunction
    from trl.models.utils import unwrap_model_for_generation

    assert compat.split_tensor_dict is trl_utils.split_tensor_dict
    assert compat.unwrap_model_for_generation is unwrap_model_for_generation
    assert compat.ChunkedLogProbFunction is ChunkedLogProbFunction
    assert compat.CHUNKED_LOGPROB_CHUNK_SIZE == trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE
    with pytest.raises(AttributeError):
        compat.no_such_name  # noqa: B018


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logprobs_matches_brute_force(with_bias):
    g = torch.Generator().manual_seed(0)
    rows, width, vocab, temperature = 9, 16, 37, 0.7
    hidden = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, requires_grad=True)
    bias = torch.randn(vocab, generator=g, requires_grad=True) if with_bias else None
    labels = torch.randint(0, vocab, (rows,), generator=g)

    log_probs, entropy, *rest = chunked_logprobs(hidden, weight, bias, labels, temperature, None, 1.0,
                                                 ("log_probs", "entropy"))
    assert all(extra is None for extra in rest)  # only the requested optional outputs

    leaves = [hidden, weight] + ([bias] if with_bias else [])
    copies = [leaf.detach().double().requires_grad_(True) for leaf in leaves]
    logits = copies[0] @ copies[1].T + (copies[2] if with_bias else 0.0)
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    expected_log_probs = log_q.gather(-1, labels[:, None]).squeeze(-1)
    expected_entropy = -(log_q.exp() * log_q).sum(-1)
    torch.testing.assert_close(log_probs.double(), expected_log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, atol=1e-5, rtol=1e-5)

    # gradients, through both outputs
    weights = torch.randn(2, rows, generator=g)
    (log_probs * weights[0] + entropy * weights[1]).sum().backward()
    (expected_log_probs * weights[0].double() + expected_entropy * weights[1].double()).sum().backward()
    for leaf, copy in zip(leaves, copies):
        torch.testing.assert_close(leaf.grad.double(), copy.grad, atol=1e-4, rtol=1e-4)


def test_chunked_logprobs_without_entropy():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(4, 8, generator=g), torch.randn(11, 8, generator=g)
    labels = torch.randint(0, 11, (4,), generator=g)
    log_probs, entropy, *_ = chunked_logprobs(hidden, weight, None, labels, 1.0, None, 1.0, ("log_probs",))
    expected = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
    assert entropy is None


# ------------------------------------------------------------------ the tables match the trainers


def test_overridden_methods_table_matches_the_trainers():
    """Every method (or class attribute) PPOWTrainer / KDTrainer redefine from their base is declared here, and
    every declared override exists: add new overrides to the tables of ppow_trl.training._trl_compat."""
    from transformers import Trainer
    from trl import GRPOTrainer

    from ppow_trl.training.kd_trainer import KDTrainer
    from ppow_trl.training.ppow_trainer import PPOWTrainer

    for cls, base, prefix in ((PPOWTrainer, GRPOTrainer, "GRPOTrainer"), (KDTrainer, Trainer, "Trainer")):
        redefined = {f"{prefix}.{name}" for name in vars(cls)
                     if hasattr(base, name) and not (name.startswith("__") and name.endswith("__"))}
        declared = {key for key in OVERRIDDEN_METHODS if key.startswith(prefix + ".")}
        declared |= {key for key in PRIVATE_ATTRIBUTES if key.startswith(prefix + ".") and key in redefined}
        assert redefined == declared, (
            f"{cls.__name__} redefines {sorted(redefined - declared)} not declared in ppow_trl.training._trl_compat; "
            f"declared but not redefined: {sorted(declared - redefined)}"
        )


def test_module_is_the_bottom_layer():
    """No import of trl/transformers/torch at load time, and nothing from ppow_trl but _compat."""
    source = Path(compat.__file__).read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                assert node.module == "_compat" and node.level == 2, ast.dump(node)  # ppow_trl._compat
            else:
                assert node.module.split(".")[0] not in ("ppow_trl", "trl", "transformers", "torch"), ast.dump(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] not in ("ppow_trl", "trl", "transformers", "torch"), alias.name


# ------------------------------------------------------------------ the checker reports changes


def test_reports_a_changed_signature(monkeypatch):
    from trl import GRPOTrainer

    def _prepare_inputs(self, inputs, num_chunks=1):  # an upgrade renamed and added parameters
        return inputs

    monkeypatch.setattr(GRPOTrainer, "_prepare_inputs", _prepare_inputs)
    problems = check_trl_contracts()
    assert problems and all(problem.startswith("GRPOTrainer._prepare_inputs") for problem in problems), problems
    signature = [p for p in problems if "changed signature" in p]
    assert len(signature) == 1, problems
    message = signature[0]
    assert "trl 1.16 has (self, generation_batch)" in message
    assert "the installed one has (self, inputs, num_chunks)" in message
    assert "ppow_trl overrides it" in message
    assert "ppow_trl supports trl>=1.16,<1.17" in message and message.endswith(PIP)


def test_reports_a_missing_name(monkeypatch):
    import trl.trainer.utils as trl_utils

    monkeypatch.delattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE")
    problems = check_touch_point("trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE")
    assert len(problems) == 1 and "is missing" in problems[0] and problems[0].endswith(PIP), problems


def test_reports_a_changed_behaviour(monkeypatch):
    from trl import GRPOTrainer

    def training_step(self, model, inputs, num_items_in_batch):  # no longer counts micro-batches
        return None

    monkeypatch.setattr(GRPOTrainer, "training_step", training_step)
    problems = check_touch_point("GRPOTrainer.training_step: self._step += 1")
    assert len(problems) == 1 and "no longer contains `self._step += 1`" in problems[0], problems
    assert problems[0].endswith(PIP)


def test_reports_a_missing_attribute_and_config_field(monkeypatch):
    monkeypatch.setitem(PRIVATE_ATTRIBUTES, "GRPOTrainer._ppow_no_such_buffer", "read: test")
    monkeypatch.setitem(GRPO_CONFIG_FIELDS, "ppow_no_such_field", "test")
    problems = check_trl_contracts()
    assert len(problems) == 2, problems
    assert "GRPOTrainer._ppow_no_such_buffer is no longer set by GRPOTrainer" in problems[0]
    assert "GRPOConfig.ppow_no_such_field is no longer a field of GRPOConfig" in problems[1]
    assert all(problem.endswith(PIP) for problem in problems)
