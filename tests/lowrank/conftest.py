import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # The suite shares a couple of cores with other jobs; with several OpenMP threads each,
    # LAPACK's SVD and the convolutions slow down by an order of magnitude. One thread keeps
    # these tests quick and their timings steady.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
