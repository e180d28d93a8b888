"""The TRL range the plugin was written and tested against, checked once at import."""

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# The trainer relies on private TRL 1.16 internals: `DPOTrainer._precompute_ref_logps`, `compute_ref_log_probs`, the
# `(rows, len - 1)` layout of the fused LM head's outputs, and `_compute_loss` summing them per row. A TRL release
# outside this range may move any of them, so it is refused rather than risked. Every private name of TRL and of the
# libraries under it that trl-padfree relies on is listed, and checked, in tests/test_seams.py: bump a pin, run it.
TESTED_TRL = (Version("1.16.0"), Version("1.17.0"))


def check_trl_version() -> None:
    try:
        installed = Version(version("trl"))
    except PackageNotFoundError as error:
        raise ImportError("trl-padfree needs TRL: `pip install 'trl>=1.16,<1.17'`.") from error
    low, high = TESTED_TRL
    if not low <= installed < high:
        raise ImportError(
            f"trl-padfree supports TRL >={low},<{high} (it subclasses private parts of DPOTrainer), but TRL {installed} "
            f"is installed. Run `pip install 'trl>={low},<{high}'`, or upgrade trl-padfree to a release that supports "
            f"TRL {installed}."
        )
