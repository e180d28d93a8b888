import os
import tempfile

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")  # keep the test log readable; set before TRL reads it
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download anything
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The pair sizes trainers cache (packing/pair_sizes.py) go to a folder of this session, not the user's HF cache
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="trl-padfree-tests-datasets-"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama saved like a checkpoint, for tests that train it in other processes (`distributed_runs.py`)."""
    from distributed_runs import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("model"))


def pytest_collection_modifyitems(config, items):
    # `slow` tests run only when asked for (`-m slow`, or any -m expression naming them), as pyproject's marker says
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip_slow = pytest.mark.skip(reason="slow: run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)
