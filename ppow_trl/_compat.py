"""Version check done at ``import ppow_trl`` (importing this module runs ``check_trl_version()``), and the one
bitsandbytes import-time warning that says nothing useful (``silence_bnb_missing_kernels_warning()``).

No heavy import here: it runs before anything imports trl.
"""

from __future__ import annotations

import logging
import os
import re

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


BNB_KERNEL_WARNINGS = {
    # bitsandbytes' CPU backend tries the optional `kernels` package's Hub kernel at import.
    "bitsandbytes.backends.cpu.ops": re.compile(
        r"Failed to load CPU gemm_4bit_forward from kernels-community: (No module named 'kernels'"
        r"|.*Hugging Face Hub is in offline mode|.*could not verify publisher trust status)"),
    # `kernels` itself, asked for that kernel with HF_HUB_OFFLINE=1.
    "kernels._internals.hf_hub": re.compile(
        r"Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because Hugging Face Hub "
        r"is in offline mode"),
}
"""Logger -> the import-time warnings that only say bitsandbytes' optional Hub kernel is not used (the `kernels`
package absent, the Hub offline or unreachable, the kernel repository not on the trust allowlist): bitsandbytes then
runs its own CPU kernel, which is all ppow_trl needs. The trust message even suggests ``trust_remote_code=True``,
which ppow_trl never needs. ``kernels`` is in the lock file (transformers pulls it), so every fresh machine printed one."""


class _DropRecords(logging.Filter):
    """Drops the records of one logger that match ``pattern``; any other failure to load that kernel, and every other
    record, still shows."""

    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.pattern.match(record.getMessage()) is None
        except Exception:  # a malformed record: let logging report it as usual
            return True


def silence_bnb_missing_kernels_warning() -> None:
    """Install those filters (``BNB_KERNEL_WARNINGS``; idempotent). It must run before bitsandbytes is imported
    (transformers, accelerate and peft import it), since the warnings are logged at import."""
    for name, pattern in BNB_KERNEL_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropRecords) for existing in logger.filters):
            logger.addFilter(_DropRecords(pattern))


check_trl_version()
silence_bnb_missing_kernels_warning()
