"""The TRL range the plugin was written and tested against, checked once at import."""

from importlib.metadata import PackageNotFoundError, version

from packaging.version import Version

# The trainer relies on private TRL 1.16 internals: `DPOTrainer._precompute_ref_logps`, `compute_ref_log_probs`, the
# `(rows, len - 1)` layout of the fused LM head's outputs, and `_compute_loss` summing them per row. A TRL release
# outside this range may move any of them, so it is refused rather than risked. Every private name of TRL and of the
# libraries under it that trl-padfree relies on is listed, and checked, in tests/integrations/test_seams.py: bump a pin, run it.
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


# transformers has no upper pin: its monthly releases bring the models users upgrade for. Every private name of it
# that trl-padfree reads is checked where it is used: a moved name that would make results wrong raises; one that
# would only make a run slower says so at WARNING level (`moved_seam_warning`), naming this tested range.
TESTED_TRANSFORMERS = (Version("5.23.0"), Version("5.25.0"))


def moved_seam_warning(what: str, lost: str) -> str:
    """The WARNING for a transformers seam that moved in a release newer than the tested ones: what could not be read,
    what the run loses, and the way out."""
    low, high = TESTED_TRANSFORMERS
    return (
        f"transformers {version('transformers')}: {what}, which trl-padfree cannot read (tested with transformers "
        f"{low} to {high}). {lost} Way out: `pip install 'transformers>={low},<={high}'`, or a trl-padfree release that "
        "supports this transformers."
    )
