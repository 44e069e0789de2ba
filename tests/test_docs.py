"""The documentation: the site builds strictly, the README stays one page, every Python example runs.

``mkdocs build --strict`` fails on a broken link, a missing page, a bad anchor or an API reference that no longer
resolves. Each page's Python blocks run in order in a fresh process (``tests/docs_examples.py``), on a tiny model with
SmolLM2's tokenizer standing in for the offline target, so a renamed argument or a moved name fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from docs_examples import python_blocks  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES_WITH_CODE = [page for page in PAGES if python_blocks(page.read_text())]


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "index.html").exists()


def test_the_readme_is_one_page_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200, "README.md grew past 200 lines: move the detail to a page under docs/"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
    for command in ("make setup && accelerate launch", "make setup && python -m pytest -q -n 2"):
        assert command in text, f"the README lost its command {command!r}"


def test_directives_are_checked():
    page = "<!-- docs-test: replace max_steps=200 => max_steps=1 -->\n```python\nx = dict(max_steps=200)\n```\n"
    (block,) = python_blocks(page)
    assert block.replacements == [("max_steps=200", "max_steps=1")] and block.skip is None
    with pytest.raises(ValueError, match="needs a reason"):
        python_blocks("<!-- docs-test: skip -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="does not occur"):
        python_blocks("<!-- docs-test: replace absent => x -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="right above"):
        python_blocks("<!-- docs-test: skip later -->\nsome prose\n```python\npass\n```\n")
    assert [b.skip for b in python_blocks("```python\n1\n```\n<!-- docs-test: skip shown only -->\n```python\n2\n```")] \
        == [None, "shown only"]


@pytest.fixture(scope="session")
def tiny_offline_target(tmp_path_factory):
    from docs_examples import make_tiny_offline_target

    return make_tiny_offline_target(tmp_path_factory.mktemp("tiny-smollm2"))


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=lambda page: str(page.relative_to(ROOT)))
def test_the_python_examples_run(page, tiny_offline_target, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PPOW_TRL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_examples.py"), str(page),
                          "--tiny-dir", str(tiny_offline_target)],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, f"{page.name}:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    assert "block(s) ran" in run.stdout


def test_every_public_name_is_in_the_api_reference():
    import ppow_trl

    reference = (ROOT / "docs" / "reference.md").read_text()
    listed = set(re.findall(r"^::: ppow_trl\.(\w+)\s*$", reference, re.MULTILINE))
    missing = sorted(set(ppow_trl.__all__) - listed)
    assert not missing, f"public names missing from docs/reference.md (add a `::: ppow_trl.NAME` line): {missing}"


def test_every_module_is_in_the_package_layout_page():
    layout = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "ppow_trl"
    missing = []
    for path in sorted(package.glob("*.py")) + sorted(package.glob("*/*.py")):
        relative = path.relative_to(package)
        if path.name in ("__init__.py", "__main__.py") or relative.parts[0] in ("bench", "study", "data"):
            continue  # a subpackage's own modules are listed by folder where the page says so
        if relative.parts[0] in ("eagle3", "dflash") or str(relative) in layout:
            continue
        missing.append(str(relative))
    assert not missing, f"modules missing from docs/architecture.md: {missing}"


# Names and paths the docs cite: every dotted `ppow_trl.` name and every repository path in README.md, docs/ (design
# notes included) and the docstrings and comments of ppow_trl/ and recipes/ resolves, so a moved module or a renamed
# file fails here, and so does a citation of a design document the repository does not hold.
REPOSITORY_DIRS = ("benchmarks", "docs", "notebooks", "ppow_trl", "recipes", "requirements", "tests", "tools", ".ci")
REPOSITORY_PATH = re.compile(r"(?<![\w./~<>-])((?:%s)/[\w./*-]*[\w*])" % "|".join(map(re.escape, REPOSITORY_DIRS)))
DOTTED_NAME = re.compile(r"(?<![\w./])ppow_trl(?:\.[A-Za-z_]\w*)+")
DESIGN_DOC = re.compile(r"(?<![\w.-])[A-Z][A-Z0-9_-]*\.md\b")  # README.md, CHANGELOG.md, ... (PPOW.md is not ours)
SECTION_CITATION = re.compile(r"\bdocs/([\w/-]+\.md),? \"([^\"]+)\"")  # docs/ppow.md "Evaluation protocol"
# Where the old module paths are the subject (they still import, with a FutureWarning naming the new one).
OLD_NAMES_ALLOWED = {"ppow_trl/_moved.py", "docs/architecture.md", "docs/changelog.md"}
# Files a documented command writes, named before any run has written them.
NOT_WRITTEN_YET = {"benchmarks/results/gpu_cost_profile.json"}  # benchmarks/gpu_check.py, on a GPU


def _cited_texts():
    """(relative path, text) of every page, and of the docstrings and comments of each file of ppow_trl/ and recipes/."""
    import ast
    import io
    import tokenize

    for page in PAGES:
        yield page.relative_to(ROOT).as_posix(), page.read_text()
    for source in sorted([*(ROOT / "ppow_trl").rglob("*.py"), *(ROOT / "recipes").rglob("*.py")]):
        tree = ast.parse(source.read_text())
        docstrings = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstrings.append(ast.get_docstring(node, clean=False) or "")
            body = getattr(node, "body", None)
            if isinstance(body, list):  # attribute docstrings: a string right after an assignment
                docstrings += [after.value.value for before, after in zip(body, body[1:])
                               if isinstance(before, (ast.Assign, ast.AnnAssign)) and isinstance(after, ast.Expr)
                               and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)]
        comments = [token.string for token in tokenize.generate_tokens(io.StringIO(source.read_text()).readline)
                    if token.type == tokenize.COMMENT]
        yield source.relative_to(ROOT).as_posix(), "\n".join(docstrings + comments)


def _unresolved_name(name: str, old_names_allowed: bool) -> str | None:
    """Why ``name`` (``ppow_trl.a.b.C.d``) does not resolve, or None: the longest importable module, then attributes."""
    import importlib
    import warnings

    from ppow_trl._moved import new_name

    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        module_name = ".".join(parts[:end])
        moved = new_name(module_name)
        if moved is not None:
            if old_names_allowed:
                module_name = moved
            else:
                return f"an old path: say {moved}{name[len('.'.join(parts[:end])):]}"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name and (module_name == error.name or module_name.startswith(error.name + ".")):
                continue
            raise
        for attribute in parts[end:]:
            if not hasattr(obj, attribute):
                return f"{'.'.join(parts[:end])} has no {attribute!r}"
            obj = getattr(obj, attribute)
        return None
    return "no such module"


def _path_exists(path: str) -> bool:
    path = path.rstrip("/.")
    if path in NOT_WRITTEN_YET:
        return True
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists() or any(ROOT.glob(path + ".*"))  # an output prefix: `--output .../bench_smollm2`


def _headings(page: Path) -> set[str]:
    return {line.lstrip("#").strip().lower() for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_cited_name_and_path_resolves():
    repository_files = {path.name for path in ROOT.rglob("*.md") if ".git" not in path.parts}
    wrong = []
    for where, text in _cited_texts():
        for name in sorted(set(DOTTED_NAME.findall(text))):
            reason = _unresolved_name(name, where in OLD_NAMES_ALLOWED)
            if reason:
                wrong.append(f"{where}: `{name}` ({reason})")
        for path in sorted(set(REPOSITORY_PATH.findall(text))):
            if not _path_exists(path):
                wrong.append(f"{where}: `{path}` (no such file or folder in the repository)")
        for doc in sorted(set(DESIGN_DOC.findall(text)) - repository_files):
            wrong.append(f"{where}: `{doc}` (not in the repository: cite a page under docs/)")
        for page, section in SECTION_CITATION.findall(text):
            if not (ROOT / "docs" / page).exists():
                wrong.append(f"{where}: docs/{page} (no such page)")
            elif section.lower() not in _headings(ROOT / "docs" / page):
                wrong.append(f"{where}: docs/{page} has no section {section!r}")
    assert not wrong, "names or paths that do not resolve:\n" + "\n".join(wrong)


def test_the_resolution_check_catches_what_it_should():
    assert _unresolved_name("ppow_trl.serving.calibration.calibrate_policy", False) is None
    assert "has no" in _unresolved_name("ppow_trl.serving.calibration.calibrate_window", False)
    assert "old path" in _unresolved_name("ppow_trl.window_logprobs", False)
    assert _unresolved_name("ppow_trl.window_logprobs", True) is None
    assert "no_such_module" in _unresolved_name("ppow_trl.no_such_module", False)
    assert REPOSITORY_PATH.findall("see `ppow_trl/compiled.py`, not ~/.cache/ppow_trl/inductor/x") == [
        "ppow_trl/compiled.py"]
    assert not _path_exists("ppow_trl/compiled.py") and _path_exists("recipes/configs/llama3_8b_4bit.yaml")
    assert DESIGN_DOC.findall("(design/PPOW.md \"Setting\"), see README.md") == ["PPOW.md", "README.md"]
    assert SECTION_CITATION.findall('(docs/ppow.md "Evaluation protocol")') == [("ppow.md", "Evaluation protocol")]
