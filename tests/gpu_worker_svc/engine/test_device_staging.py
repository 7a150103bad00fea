"""DeviceStaging packs a step's tensors into one buffer and unpacks them as views, dtypes and shapes kept.

Its CUDA copies and events run only on a GPU (benchmarks/gpu_check.py); the packing runs anywhere.
"""

import torch

from gpu_worker_svc.engine.device_staging import DeviceStaging


def test_tensors_of_every_dtype_and_shape_come_back_equal_from_one_buffer():
    staging = DeviceStaging("cpu")
    tensors = [
        torch.arange(7),
        torch.tensor([[True, False, True]]).expand(4, 3),  # not contiguous
        torch.empty(0, dtype=torch.long),
        torch.rand(2, 1, 1, 5) > 0.5,
        torch.tensor(3),
        torch.randn(3, 2),
    ]
    for _ in range(3):  # the buffers are used in turn and reused
        moved = staging.to_device(tensors)
        assert len({t.untyped_storage().data_ptr() for t in moved if t.numel()}) == 1
        for before, after in zip(tensors, moved, strict=True):
            assert after.dtype == before.dtype and after.shape == before.shape
            assert torch.equal(after, before)


def test_a_buffer_grows_for_a_larger_step_and_fetched_tokens_come_back():
    staging = DeviceStaging("cpu")
    small = staging.to_device([torch.arange(4)])[0]
    large = staging.to_device([torch.arange(10_000)])[0]
    assert small.tolist() == [0, 1, 2, 3] and large.tolist() == list(range(10_000))
    assert staging.start_fetch(torch.tensor([5, 6, 7])).wait() == [5, 6, 7]
