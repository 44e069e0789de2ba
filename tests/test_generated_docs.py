"""Generated numbers only: docs/benchmarks.md and the README's results table come from benchmarks/results/*.json.

``tools/render_numbers.py`` regenerates both; these tests regenerate in memory and compare (so a result committed
without regenerating, or a figure edited by hand, fails), and check on a tiny synthetic result that only the README's
block between its markers is replaced. No network, no model: the study sections only read JSON.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "tools" / "render_numbers.py"


@pytest.fixture(scope="module")
def render_numbers():
    spec = importlib.util.spec_from_file_location("render_numbers_under_test", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_and_readme_table_are_up_to_date(render_numbers):
    message = render_numbers.check(ROOT)
    assert message is None, message


def test_every_result_file_has_its_section(render_numbers):
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert "## Other results" not in page, "a JSON under benchmarks/results/ has no section in tools/render_numbers.py"
    assert f"## {render_numbers.COMPILED_SERVING_HEADING}\n" in page
    assert "](../" not in page and "![" not in page  # nothing outside docs/ is linked (the site would not serve it)


def _arm(speedup: float, eager: float, tau: float, lossless: str) -> dict:
    return {"prompts": 3, "ms_per_token_median": 30.0 / speedup, "ms_per_token_ci95": [20.0, 40.0], "tau": tau,
            "lossless_prompts": lossless, "agrees_with_eager_prompts": "3/3", "new_tokens": 96,
            "speedup_vs_compiled_plain[fp32]": speedup, "speedup_vs_compiled_plain[fp32]_ci95": [speedup - 0.1,
                                                                                                  speedup + 0.1],
            "speedup_vs_hf_generate_eager": eager, "speedup_vs_hf_generate_eager_ci95": [eager - 0.2, eager + 0.2]}


def _synthetic_results(root: Path) -> None:
    arms = {"hf_generate_eager": _arm(0.5, 1.0, 1.0, "reference"),
            "compiled_plain[fp32]": _arm(1.0, 2.0, 1.0, "reference"),
            "compiled_speculative[prompt_lookup]": _arm(1.25, 2.5, 1.375, "3/3")}
    data = {"command": "python benchmarks/compiled_serving.py --mtbench 3 --code 3 --threads 1",
            "meta": {"threads1": {"cpu": {"model": "Test CPU", "avx512f": True, "amx": False, "cores": 4},
                                  "torch": "9.9.9", "threads": 1, "max_new_tokens": 32}},
            "runs": {"threads1/mtbench": {"prompts": 3, "skipped_too_long": 0, "arms": arms},
                     "threads1/code": {"prompts": 3, "skipped_too_long": 1, "arms": arms}}}
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "compiled_serving.json").write_text(json.dumps(data))


def test_the_readme_block_is_replaced_between_the_markers_and_nothing_else(render_numbers, tmp_path):
    _synthetic_results(tmp_path)
    begin, end = render_numbers.README_BEGIN, render_numbers.README_END
    head = "# Project\n\nProse that stays as it is, 1.23x included.\n\n"
    tail = "\n\n## Next section\n\nMore prose.\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"{head}{begin}\nan old table\n{end}{tail}")
    assert {p.as_posix() for p in render_numbers.stale(tmp_path)} == {"README.md", "docs/benchmarks.md"}

    render_numbers.write(tmp_path)
    text = readme.read_text()
    assert text.startswith(head + begin + "\n") and text.endswith("\n" + end + tail)
    block = text[len(head + begin):-len(end + tail)]
    assert "an old table" not in block
    assert "1.25x [1.15, 1.35]" in block and "2.50x [2.30, 2.70]" in block and "1.38" in block  # from the JSON
    assert "Test CPU" in block and "AVX-512 yes" in block and "AMX no" in block and "1 thread" in block
    assert "fp32" in block and "3 MT-bench prompts" in block and "1 longer than the static cache passed over" in block
    assert "(docs/benchmarks.md#compiled-serving)" in block
    assert len(block.strip("\n").splitlines()) <= 15
    page = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "## Compiled serving\n" in page and "### Compiled serving at 1 thread" in page
    assert render_numbers.check(tmp_path) is None and render_numbers.write(tmp_path) == []  # idempotent

    readme.write_text(text.replace("1.25x", "1.26x", 1))  # a figure edited by hand
    message = render_numbers.check(tmp_path)
    assert message and "README.md" in message and "python tools/render_numbers.py" in message
    run = subprocess.run([sys.executable, str(GENERATOR), "--check", "--root", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and "README.md" in run.stderr and "python tools/render_numbers.py" in run.stderr


@pytest.mark.parametrize("readme", [
    "# Project\n\nno markers at all\n",
    "# Project\n\n<!-- results:begin -->\nno end marker\n",
    "# Project\n\nno begin marker\n<!-- results:end -->\n",
    "# Project\n\n<!-- results:end -->\nreversed\n<!-- results:begin -->\n",
    "<!-- results:begin -->\n<!-- results:end -->\n<!-- results:begin -->\n<!-- results:end -->\n",
])
def test_a_missing_or_broken_marker_is_a_clear_error(render_numbers, tmp_path, readme):
    _synthetic_results(tmp_path)
    (tmp_path / "README.md").write_text(readme)
    with pytest.raises(render_numbers.MarkerError, match=r"README\.md: .*results:(begin|end)"):
        render_numbers.render_all(tmp_path)
    assert (tmp_path / "README.md").read_text() == readme  # nothing written


def test_local_folders_of_the_machine_a_run_used_are_not_printed(render_numbers):
    text = "--drafter /work/drafter_prev_run/merged and /tmp/pytest-1/x and benchmarks/results/a.json"
    assert render_numbers.without_local_paths(text) == \
        "--drafter <local folder>/merged and <local folder>/x and benchmarks/results/a.json"
