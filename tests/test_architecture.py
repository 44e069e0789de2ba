"""The package's structure as contracts: import layers, independent families, no family-name branches in callers."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ppow_trl.drafting import DraftingSession, DrafterFamily, family_names, get_family

ROOT = Path(__file__).resolve().parents[1]
FAMILY_PACKAGES = ("ppow_trl/drafters/standalone.py", "ppow_trl/drafters/eagle3/", "ppow_trl/drafters/dflash/",
                   "ppow_trl/drafters/prompt_lookup.py", "ppow_trl/drafting.py")


def _lint_imports(config: Path) -> subprocess.CompletedProcess:
    command = shutil.which("lint-imports")
    if command is None:
        pytest.fail("import-linter is not installed: `pip install -e .[test]` (setup.cfg's test extra) installs it.")
    return subprocess.run([command, "--config", str(config), "--no-cache"], cwd=ROOT, capture_output=True, text=True)


def test_import_layers_and_family_independence_hold():
    """setup.cfg's import-linter contracts (layers of modules, independent families, the subpackages stacked, the shared
    modules below them; function-local imports count): a failure names the import."""
    result = _lint_imports(ROOT / "setup.cfg")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


def test_the_contracts_catch_an_import_that_runs_back_up(tmp_path):
    """The layers contract is not vacuous: a copy of the package where the protocol imports a family fails it,
    and the message names the import."""
    package = tmp_path / "ppow_trl"
    shutil.copytree(ROOT / "ppow_trl", package, ignore=shutil.ignore_patterns("__pycache__"))
    drafting = package / "drafting.py"
    drafting.write_text(drafting.read_text().replace("from .utils import unwrap_model",
                                                     "from .utils import unwrap_model\nfrom .drafters.eagle3 import family"))
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    command = shutil.which("lint-imports")
    if command is None:
        pytest.fail("import-linter is not installed: `pip install -e .[test]` installs it.")
    result = subprocess.run([command, "--config", "setup.cfg", "--no-cache"], cwd=tmp_path, capture_output=True,
                            text=True, env={"PYTHONPATH": str(tmp_path), "PATH": str(Path(sys.executable).parent)})
    assert result.returncode != 0
    assert "ppow_trl.drafting -> ppow_trl.drafters.eagle3.family" in result.stdout


def _family_branches() -> list[str]:
    """Lines outside the family packages and the registry that compare something with a family's name."""
    names = "|".join(sorted(map(re.escape, [*family_names(), "block", "chain"])))
    pattern = re.compile(rf"""(==|!=)\s*["']({names})["']|["']({names})["']\s*(==|!=)""")
    found = []
    for folder in ("ppow_trl", "recipes"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith(FAMILY_PACKAGES):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "method" not in line:  # bench *methods* may share a family's name
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_caller_branches_on_a_family_name():
    """Callers ask the family (``family_of`` / ``get_family``) instead of comparing names."""
    assert _family_branches() == []


@pytest.mark.parametrize("name", family_names())
def test_every_registered_family_implements_the_protocol(name):
    family = get_family(name)
    assert isinstance(family, DrafterFamily) and family.name == name and family.description
    session_class = type(family).session  # overridden: every family drafts
    assert session_class is not DrafterFamily.session
    for method in ("owns", "detect", "load", "attach"):
        assert getattr(type(family), method) is not getattr(DrafterFamily, method), f"{name} lacks {method}"
    if family.trainable:
        for method in ("build", "window_hidden", "kd_rows", "response_distributions"):
            assert getattr(type(family), method) is not getattr(DrafterFamily, method), f"{name} lacks {method}"
    members = [m for m in dir(DraftingSession) if not m.startswith("_")]
    assert {"prefill", "extend", "step", "rollback", "teacher_forced_logits", "timed_step"} <= set(members)
