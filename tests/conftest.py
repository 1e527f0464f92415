import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))   # lets tests import the shared `tiny` helpers
sys.path.insert(1, os.path.join(os.path.dirname(__file__), "server"))   # ... and `tiny_server`
torch.set_num_threads(min(2, torch.get_num_threads()))

import pytest  # noqa: E402

from dspark.kernels import cpu as cpu_kernels  # noqa: E402
from kernel_paths import KERNEL_PATHS  # noqa: E402
from tiny import share_kernels  # noqa: E402

pytest_plugins = ["cuda_selection",      # `cuda` tests: deselected by default without a GPU
                  "pytester"]            # (tested with pytester, enabled here: the top conftest)


@pytest.fixture(params=KERNEL_PATHS)
def amx(request, monkeypatch):
    """Run a test on one path of the kernels: packing (and so fusing) follows `tiles_available`,
    which this pins for the test (a CPU with AMX can run the vector path too)."""
    monkeypatch.setattr(cpu_kernels, "tiles_available", lambda: request.param)
    return request.param


@pytest.fixture(autouse=True, scope="session")
def private_cost_models(tmp_path_factory):
    """What test engines cache (cost models, graph choices) goes to the session's own folder, not
    the user's cache (every tiny drafter is a new setup: each would leave a file there). Set in
    the environment, so that processes the tests spawn (data-parallel ranks) inherit it."""
    folder = tmp_path_factory.mktemp("xdg_cache")
    share_kernels(folder)
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_CACHE_HOME", str(folder))
    yield folder / "dspark"
    patch.undo()

