import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):       # `pytest -n 2`: one core per worker, and for what it starts
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def addition():
    import tasks
    return tasks.addition_task(2)


@pytest.fixture(scope="session")
def tiny_path(addition):
    """The warm-started embedded model (built once, ~30 s, then cached on disk)."""
    import demo
    return demo.tiny_model(addition)


@pytest.fixture
def optional():
    """optional(module, why): the module, imported; if it is not installed the test is skipped,
    saying how to install it, except where REPLAY_RL_REQUIRE_OPTIONAL=1 (CI installs the optional
    packages and sets it): there a missing one fails the test."""
    import importlib

    def need(module: str, why: str):
        if importlib.util.find_spec(module) is None:
            message = f"{module} is not installed ({why}): pip install {module}"
            if os.environ.get("REPLAY_RL_REQUIRE_OPTIONAL") == "1":
                pytest.fail(message + " (REPLAY_RL_REQUIRE_OPTIONAL=1)")
            pytest.skip(message)
        return importlib.import_module(module)
    return need
