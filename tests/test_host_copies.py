"""Host numbers reach the device without a host sync (``kernels.host.on_device``), device values are read back
later without draining the stream (``HostRead``), and ``Launches`` counts the copies that would wait
(``torch.tensor``/``torch.as_tensor`` of host numbers with ``device=``) on any device."""

import pytest
import torch

from kvgates.kernels.host import LAUNCH_BOUND_ENV, HostRead, launch_bound, on_device
from kvgates.runtime.launches import Launches


def test_launches_counts_a_tensor_made_from_host_numbers_on_a_device_as_a_sync():
    with Launches() as counted:
        torch.tensor([1, 2], device="cpu")
        torch.as_tensor(3, device="cpu")
    assert counted.sync_ops == {"upload": 2}


def test_launches_counts_data_given_by_keyword():
    with Launches() as counted:
        torch.tensor(data=[1, 2], device="cpu")
        torch.as_tensor(data=torch.ones(2), device="cpu")
    assert counted.sync_ops == {"upload": 1}


def test_launches_counts_neither_host_tensors_nor_moved_tensors_nor_on_device():
    t = torch.ones(2)
    with Launches() as counted:
        torch.tensor([1, 2])
        torch.as_tensor(t, device="cpu")
        on_device([1, 2], "cpu")
        on_device(3, "cpu", torch.float32)
    assert counted.sync_ops == {}


def test_on_device_gives_the_values_dtype_and_device():
    assert torch.equal(on_device([[1], [2]], "cpu"), torch.tensor([[1], [2]]))
    assert on_device(3, "cpu").shape == () and int(on_device(3, "cpu")) == 3
    assert on_device([1, 2], "cpu", torch.float32).dtype == torch.float32
    moved = on_device(torch.tensor([1, 2]), "cpu", torch.float64)
    assert moved.dtype == torch.float64 and moved.tolist() == [1.0, 2.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_a_pageable_copy_syncs_and_on_device_does_not():
    """The premise, on a GPU: CUDA's sync debug mode raises on the stream sync of a pageable host-to-device copy,
    not on ``on_device``'s copy from pinned memory."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        values = on_device([1, 2, 3], "cuda", torch.int64)
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2, 3], device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert values.device.type == "cuda" and values.tolist() == [1, 2, 3]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))])
def test_host_read_gives_the_values_when_asked(device):
    values = torch.arange(6, device=device).reshape(2, 3)
    later = HostRead(values * 2)
    values.zero_()  # (work queued after the read's copy does not change what it reads)
    assert later.tolist() == [[0, 2, 4], [6, 8, 10]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_cuda_a_host_read_queues_its_copy_without_a_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        later = HostRead(torch.arange(4, device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert later.tolist() == [0, 1, 2, 3]


def test_a_gpu_is_launch_bound_and_the_cpu_is_when_told(monkeypatch):
    monkeypatch.delenv(LAUNCH_BOUND_ENV, raising=False)
    assert launch_bound(torch.device("cuda")) and not launch_bound(torch.device("cpu"))
    monkeypatch.setenv(LAUNCH_BOUND_ENV, "1")
    assert launch_bound(torch.device("cpu"))
