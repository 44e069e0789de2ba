"""The public API and the package layout: the top-level names, the subpackages' names, the old module paths (they
import as the moved modules, with a FutureWarning), and the modules allowed at the top of the package."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import warnings
from pathlib import Path

import pytest

import ppow_trl
from ppow_trl._moved import MOVED, new_name

PACKAGE = Path(ppow_trl.__file__).resolve().parent

TOP_LEVEL_NAMES = [
    "AdaptiveWindowPolicy",
    "CostModel",
    "DrafterFamily",
    "Eagle3DrafterConfig",
    "Eagle3DrafterForCausalLM",
    "KDConfig",
    "KDTrainer",
    "OFFLINE_TARGET",
    "PPOWConfig",
    "PPOWDrafterConfig",
    "PPOWDrafterForCausalLM",
    "PPOWTrainer",
    "acceptance_probabilities",
    "build_draft_vocab",
    "calibrate_cost_model",
    "calibrate_for_serving",
    "check_compatibility",
    "describe_serving_rule",
    "divergence",
    "divergence_scores",
    "draft_vocab_coverage",
    "exact_greedy_tau",
    "expected_accepted_length",
    "export_gguf",
    "family_of",
    "get_family",
    "greedy_accepted_length",
    "greedy_verify",
    "held_out_contexts",
    "hybrid_drafter",
    "load_assistant",
    "load_drafter",
    "load_target",
    "make_drafter",
    "overall_speedup",
    "proximity_reward",
    "register_family",
    "residual_distribution",
    "save_assistant",
    "serving_runtime",
    "speculative_generate",
    "speculative_sampling_verify",
    "speedup",
    "window_reward",
    "window_start_probabilities",
]

# What stands at the top of ppow_trl/: the package's face, the modules every subpackage shares (the family registry,
# the target features, the reduced-vocabulary drafter model, batching, models, utilities), the demo, and the
# subpackages. A new module goes into a subpackage; adding one here is a decision about the layout. `caches` (the
# `python -m ppow_trl.caches` command) reads the cache layouts of data/ and compiled_runtime/, so it stands above both,
# like demo.
TOP_LEVEL_MODULES = {
    "__init__", "_compat", "_moved", "batching", "build_once", "caches", "demo", "drafter", "drafting", "features",
    "models",
    "offline", "padding", "utils",
    "bench", "compiled_runtime", "core", "data", "drafters", "interop", "metrics", "serving", "study", "training",
}

SUBPACKAGES = ("ppow_trl.core", "ppow_trl.compiled_runtime", "ppow_trl.serving", "ppow_trl.training",
               "ppow_trl.drafters", "ppow_trl.interop", "ppow_trl.drafters.eagle3", "ppow_trl.drafters.dflash")


def test_top_level_names():
    assert sorted(ppow_trl.__all__) == sorted(TOP_LEVEL_NAMES)
    assert len(ppow_trl.__all__) == len(set(ppow_trl.__all__))
    for name in ppow_trl.__all__:
        assert getattr(ppow_trl, name) is not None


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_name_of_a_subpackage_resolves(name):
    package = importlib.import_module(name)
    assert package.__doc__, f"{name} says what it is"
    assert package.__all__ and len(package.__all__) == len(set(package.__all__))
    for attribute in package.__all__:
        assert getattr(package, attribute) is not None, f"{name}.{attribute}"


def test_nothing_else_stands_at_the_top_of_the_package():
    found = {path.stem for path in PACKAGE.glob("*.py")}
    found |= {path.name for path in PACKAGE.iterdir() if path.is_dir() and any(path.glob("*.py"))}
    assert found == TOP_LEVEL_MODULES


def _old_and_new_paths() -> list[tuple[str, str]]:
    """Every entry of the table, and for a moved package each of its submodules under the old name too."""
    pairs = []
    for old, new in sorted(MOVED.items()):
        pairs.append((old, new))
        module = importlib.import_module(new)
        if hasattr(module, "__path__"):
            for info in pkgutil.walk_packages(module.__path__, prefix=f"{old}."):
                pairs.append((info.name, new_name(info.name)))
    return pairs


@pytest.mark.parametrize(("old", "new"), _old_and_new_paths())
def test_an_old_module_path_imports_as_the_moved_module_with_a_warning(old, new, monkeypatch):
    assert not (PACKAGE / (old.split(".", 1)[1].replace(".", "/") + ".py")).exists()
    moved = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(FutureWarning, match=rf"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is moved and sys.modules[old] is sys.modules[new]
    assert module.__name__ == module.__spec__.name == new  # the module keeps its own spec


@pytest.mark.parametrize("old", sorted(name for name in MOVED if name.count(".") == 1))
def test_an_old_module_is_an_attribute_of_the_package_with_a_warning(old, monkeypatch):
    name = old.split(".")[1]
    # Through the module's dict: hasattr (as monkeypatch.delattr asks it) would already import the old name.
    monkeypatch.delitem(vars(ppow_trl), name, raising=False)
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(FutureWarning, match=rf"{old} moved"):
        assert getattr(ppow_trl, name) is importlib.import_module(MOVED[old])


def test_old_from_imports_of_names_work():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from ppow_trl.eagle3.family import Eagle3Family
        from ppow_trl.verification import greedy_verify
    from ppow_trl.drafters.eagle3.family import Eagle3Family as new_family
    from ppow_trl.core.verification import greedy_verify as new_verify

    assert Eagle3Family is new_family and greedy_verify is new_verify


def test_what_left_the_serving_package_resolves_through_it_with_a_warning(monkeypatch):
    """``ppow_trl.serving`` exported the core's and the compiled runtime's names before they moved out: they resolve
    there still, as the same objects, with a FutureWarning naming the new package; so do the modules that left it, as
    attributes."""
    import ppow_trl.core
    import ppow_trl.compiled_runtime
    from ppow_trl import serving

    for package, name in ((ppow_trl.core, "CostModel"), (ppow_trl.core, "greedy_verify"),
                          (ppow_trl.compiled_runtime, "CompiledCausalLM")):
        monkeypatch.delitem(vars(serving), name, raising=False)
        with pytest.warns(FutureWarning, match=rf"ppow_trl.serving.{name} moved to {package.__name__}.{name}"):
            assert getattr(serving, name) is getattr(package, name)
    monkeypatch.delitem(vars(serving), "rewards", raising=False)
    monkeypatch.delitem(sys.modules, "ppow_trl.serving.rewards", raising=False)
    with pytest.warns(FutureWarning, match="ppow_trl.serving.rewards moved to ppow_trl.core.rewards"):
        assert serving.rewards is importlib.import_module("ppow_trl.core.rewards")
    with pytest.raises(AttributeError):
        serving.no_such_name  # noqa: B018


def test_the_old_serving_module_is_the_serving_package():
    """``ppow_trl.serving`` was the served rule's module and is now the subpackage: it keeps that module's names."""
    from ppow_trl import serving
    from ppow_trl.serving import rule

    for name in ("calibrate_for_serving", "describe_serving_rule", "DEFAULT_GUARD"):
        assert getattr(serving, name) is getattr(rule, name)
    assert "ppow_trl.serving" not in MOVED


def test_unknown_attributes_and_modules_still_fail():
    with pytest.raises(AttributeError):
        ppow_trl.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("ppow_trl.no_such_module")
