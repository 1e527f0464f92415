import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The training tests run many tiny ops, where a second thread costs more in synchronisation
    than it gains (20 ms vs 0.5 s per tiny step on the shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
