"""host_copy.to_device on the GPU: copies through the ring of pinned staging buffers arrive
intact while the stream is busy and the ring wraps several times (a slot is never refilled
before the copy out of it has run), at sizes that outgrow a slot's buffer."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvfleet.engine.layers import host_copy  # noqa: E402


def test_copies_arrive_intact_while_the_stream_is_busy_and_the_ring_wraps() -> None:
    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    sent, arrived = [], []
    torch.cuda._sleep(200_000_000)  # (~0.1 s of GPU time queued before every copy)
    for i in range(5 * host_copy.SLOTS):
        size = int(rng.integers(1, 3000)) * (1 + (i % 7 == 0) * 40)  # some outgrow their slot
        values = rng.integers(-(2**40), 2**40, size=size)
        sent.append(values.copy())
        arrived.append(host_copy.to_device(values, device))
        values[:] = 0  # (the caller's array is free to change once to_device returns)
    floats = host_copy.column([0.5, -1.25, 3.0], torch.float32, device)
    torch.cuda.synchronize()
    for values, tensor in zip(sent, arrived, strict=True):
        assert np.array_equal(tensor.cpu().numpy(), values)
    assert floats.tolist() == [0.5, -1.25, 3.0]
