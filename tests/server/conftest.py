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
