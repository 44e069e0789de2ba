"""Old module paths of ppow_trl, kept importable after the modules moved into subpackages.

``MOVED`` maps an old dotted name to the module's new one. ``import ppow_trl.generation`` (or ``from
ppow_trl.verification import greedy_verify``) imports the new module, returns that same object
(``sys.modules[old] is sys.modules[new]``: one module, one set of classes) and warns once with a ``FutureWarning``
naming the new path. A moved package takes its submodules along: ``ppow_trl.eagle3.family`` is
``ppow_trl.drafters.eagle3.family``. ``ppow_trl.<old name>`` as an attribute works the same way (the package's
``__getattr__`` is ``moved_attribute``; ``ppow_trl.serving``'s own ``__getattr__`` does it for the modules that left
it). A module that moved twice maps from both old names to where it is now: ``ppow_trl.rewards`` and
``ppow_trl.serving.rewards`` are ``ppow_trl.core.rewards``. Inside the project only the new paths are used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

MOVED: dict[str, str] = {
    "ppow_trl._family_io": "ppow_trl.drafters._family_io",
    "ppow_trl._trl_compat": "ppow_trl.training._trl_compat",
    "ppow_trl.assistant_loop": "ppow_trl.serving.assistant_loop",
    "ppow_trl.assisted": "ppow_trl.serving.assisted",
    "ppow_trl.cached_verification": "ppow_trl.training.cached_verification",
    "ppow_trl.calibration": "ppow_trl.serving.calibration",
    "ppow_trl.compiled": "ppow_trl.compiled_runtime.compiled",
    "ppow_trl.contexts": "ppow_trl.training.contexts",
    "ppow_trl.cost": "ppow_trl.core.cost",
    "ppow_trl.credit": "ppow_trl.core.credit",
    "ppow_trl.custom_generate": "ppow_trl.core.custom_generate",
    "ppow_trl.dflash": "ppow_trl.drafters.dflash",
    "ppow_trl.eagle3": "ppow_trl.drafters.eagle3",
    "ppow_trl.generation": "ppow_trl.serving.generation",
    "ppow_trl.gguf_export": "ppow_trl.interop.gguf_export",
    "ppow_trl.held_out": "ppow_trl.training.held_out",
    "ppow_trl.hybrid": "ppow_trl.drafters.hybrid",
    "ppow_trl.kd_trainer": "ppow_trl.training.kd_trainer",
    "ppow_trl.llama_cpp_build": "ppow_trl.interop.llama_cpp_build",
    "ppow_trl.llama_cpp_draft": "ppow_trl.interop.llama_cpp_draft",
    "ppow_trl.model_card": "ppow_trl.training.model_card",
    "ppow_trl.on_policy": "ppow_trl.training.on_policy",
    "ppow_trl.ppow_config": "ppow_trl.training.ppow_config",
    "ppow_trl.ppow_trainer": "ppow_trl.training.ppow_trainer",
    "ppow_trl.prompt_lookup": "ppow_trl.drafters.prompt_lookup",
    "ppow_trl.rewards": "ppow_trl.core.rewards",
    "ppow_trl.rollout": "ppow_trl.core.rollout",
    "ppow_trl.runtime": "ppow_trl.serving.runtime",
    "ppow_trl.serving.attention": "ppow_trl.compiled_runtime.attention",
    "ppow_trl.serving.compiled": "ppow_trl.compiled_runtime.compiled",
    "ppow_trl.serving.cost": "ppow_trl.core.cost",
    "ppow_trl.serving.credit": "ppow_trl.core.credit",
    "ppow_trl.serving.custom_generate": "ppow_trl.core.custom_generate",
    "ppow_trl.serving.inductor_settings": "ppow_trl.compiled_runtime.inductor_settings",
    "ppow_trl.serving.package_store": "ppow_trl.compiled_runtime.package_store",
    "ppow_trl.serving.packaged": "ppow_trl.compiled_runtime.packaged",
    "ppow_trl.serving.precision": "ppow_trl.compiled_runtime.precision",
    "ppow_trl.serving.rewards": "ppow_trl.core.rewards",
    "ppow_trl.serving.rollout": "ppow_trl.core.rollout",
    "ppow_trl.serving.row_check": "ppow_trl.compiled_runtime.row_check",
    "ppow_trl.serving.verification": "ppow_trl.core.verification",
    "ppow_trl.serving.windowing": "ppow_trl.core.windowing",
    "ppow_trl.standalone": "ppow_trl.drafters.standalone",
    "ppow_trl.verification": "ppow_trl.core.verification",
    "ppow_trl.window_logprobs": "ppow_trl.training.window_logprobs",
    "ppow_trl.windowing": "ppow_trl.core.windowing",
}


def new_name(old: str) -> str | None:
    """The new dotted name of ``old`` (a module in ``MOVED``, or a submodule of a package in it), else ``None``."""
    if not old.startswith("ppow_trl."):
        return None
    if old in MOVED:
        return MOVED[old]
    package = old.rpartition(".")[0]
    while package != "ppow_trl":
        if package in MOVED:
            return f"{MOVED[package]}.{old[len(package) + 1:]}"
        package = package.rpartition(".")[0]
    return None


def _stacklevel() -> int:
    """The warning's stack level: the import line, past this file and importlib (counted as ``warnings`` counts:
    it skips importlib's bootstrap frames itself)."""
    frame, level = sys._getframe(1), 1  # the caller, create_module, is level 1
    while frame.f_back is not None:
        frame = frame.f_back
        name = frame.f_code.co_filename
        if "importlib" in name and "_bootstrap" in name:
            continue
        level += 1
        if name != __file__ and f"{os.sep}importlib{os.sep}" not in name:
            break
    return level


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new name (imported first): the same object, with its own spec."""

    def __init__(self, new: str):
        self.new = new
        self.spec = None  # the moved module's own spec

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}: import it from there (the old path will be removed).",
                      FutureWarning, stacklevel=_stacklevel())
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module):
        # module_from_spec gave the module the old name's spec: give it its own back (pickling, reload, -m).
        module.__spec__ = self.spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the old names of ``MOVED`` (first on ``sys.meta_path``, so a package's old name cannot load a second
    copy of one of its submodules from the new folder)."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _MovedLoader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def moved_attribute(name: str):
    """``ppow_trl.<name>`` for an old submodule name (``ppow_trl.generation``): the moved module, imported by its old
    name (so it warns); any other name raises ``AttributeError``."""
    old = f"ppow_trl.{name}"
    if old not in MOVED:
        raise AttributeError(f"module 'ppow_trl' has no attribute {name!r}")
    return importlib.import_module(old)


install()
