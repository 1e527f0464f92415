import types

import pytest
import torch

from train_helpers import generate_tiny_data, tiny_target


@pytest.fixture(autouse=True)
def one_thread():
    """The training tests run many tiny ops, where a second thread costs more in synchronisation
    than it gains (20 ms vs 0.5 s per tiny step on the shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny target (4 layers, vocab 96) and 60 generated responses, shared by a module."""
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_target(str(root / "target"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the engine below would keep whatever it finds
    cfg = generate_tiny_data(target, str(root / "data"), num=60, max_tokens=32, chunk_size=32)
    torch.set_num_threads(threads)
    return types.SimpleNamespace(root=root, target=target, data=cfg.data_dir)
