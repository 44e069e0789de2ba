"""The install is pinned: the lock file covers every requirement, the docs state its versions, setup uses it."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "requirements" / "cpu-py311.txt"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if match:
            pins[_canonical(match.group(1))] = match.group(2)
    return pins


def _requirement_names(lines: str) -> set[str]:
    return {_canonical(re.split(r"[<>=!~;\[ ]", line.strip())[0]) for line in lines.strip().splitlines() if line.strip()}


def test_lock_file_pins_every_requirement_exactly():
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    required = _requirement_names(config["options"]["install_requires"])
    for extra in ("test", "quantization", "bench"):
        required |= _requirement_names(config["options.extras_require"][extra])
    pins = _pins()
    assert required - set(pins) == set(), "requirements without a tested version: run `make lock`"
    # torch without a local label: the pin matches the CPU build (2.13.0+cpu) and a CUDA build of the same release
    assert "+" not in pins["torch"]


def test_setup_installs_with_the_lock_file():
    makefile = (REPO / "Makefile").read_text()
    assert "CONSTRAINTS ?= requirements/cpu-py311.txt" in makefile
    setup = makefile.split("\nsetup:")[1].split("\n\n")[0]
    assert setup.count("$(PIN)") == 2  # torch and the package with its extras; the rest is --no-deps
    assert "$(PIN) openai loguru" in makefile and "--constraints $(CONSTRAINTS)" in makefile


def test_docs_state_the_tested_versions():
    table = dict(re.findall(r"^\| ([a-z][a-z0-9-]*) \| ([0-9][0-9.]*)", (REPO / "docs" / "install.md").read_text(),
                            re.MULTILINE))
    pins = _pins()
    assert {"torch", "transformers", "trl", "peft", "accelerate", "datasets", "llama-cpp-python"} <= set(table)
    assert {name: pins.get(name, "not in the lock file") for name in table} == table, "update docs/install.md"
