import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
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
