"""Version check done at ``import ppow_trl`` (importing this module runs ``check_trl_version()``).

No heavy import here: it runs before anything imports trl.
"""

from __future__ import annotations

import os

SUPPORTED_TRL = (1, 16)
"""The trl minor version whose private ``GRPOTrainer`` methods ``PPOWTrainer`` overrides (setup.cfg pins it)."""
SUPPORTED_TRL_RANGE = ">=1.16,<1.17"
SKIP_CHECK_ENV = "PPOW_TRL_SKIP_TRL_CHECK"


def installed_trl_version() -> str | None:
    """The installed trl's version from its distribution metadata (trl is not imported), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return None


def check_trl_version(installed: str | None = None) -> None:
    """Raise ImportError unless the installed trl is 1.16.x (pre-releases of 1.16 included).

    ``PPOWTrainer`` overrides private methods of trl's ``GRPOTrainer`` (``_generate_and_score_completions`` and
    the rollout and reward plumbing it calls), which change between minor versions without notice, so another trl
    would fail later in obscure ways. ``$PPOW_TRL_SKIP_TRL_CHECK=1`` skips the check (at your own risk).
    """
    if os.environ.get(SKIP_CHECK_ENV, "") not in ("", "0"):
        return
    installed = installed_trl_version() if installed is None else installed
    if installed is None:
        raise ImportError(
            f'ppow_trl needs trl{SUPPORTED_TRL_RANGE}, which is not installed: pip install "trl{SUPPORTED_TRL_RANGE}"'
        )
    if _major_minor(installed) != SUPPORTED_TRL:
        raise ImportError(
            f"ppow_trl supports trl{SUPPORTED_TRL_RANGE} (PPOWTrainer overrides private methods of that version's "
            f'GRPOTrainer), but trl {installed} is installed. Install the supported version: pip install "trl'
            f'{SUPPORTED_TRL_RANGE}" (or set {SKIP_CHECK_ENV}=1 to import anyway, at your own risk).'
        )


def _major_minor(version: str) -> tuple[int, ...] | None:
    from packaging.version import InvalidVersion, Version  # a dependency of transformers

    try:
        return Version(version).release[:2]
    except InvalidVersion:
        return None


check_trl_version()
