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
