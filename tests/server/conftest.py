import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # the shared `tiny_server` helpers

from tiny_server import make_drafter, make_target  # noqa: E402


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory) -> str:
    return make_target(str(tmp_path_factory.mktemp("server_target")))


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory, target_dir) -> str:
    return make_drafter(str(tmp_path_factory.mktemp("server_drafter")), target_dir)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """Tiny models gain nothing from intra-op threads, and here the server's own threads (event
    loop, engine, clients) share two cores: an OpenMP team waiting on a descheduled member turns
    a microsecond matrix-vector product into milliseconds.  Restored afterwards."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
