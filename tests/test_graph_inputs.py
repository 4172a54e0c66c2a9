"""The packed inputs of a decode CUDA graph (engine.graph_runner.decode_inputs), checked on CPU:
the layout one host-to-device copy fills."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.graph_runner import DecodeInputs, decode_inputs, packed_len


@pytest.mark.parametrize("bucket", [1, 2, 3, 4, 8, 13, 24, 256])
def test_decode_inputs_views(bucket: int) -> None:
    """Four views that do not overlap, lie within the packed buffer, start 16-byte aligned and
    have the dtypes the kernels take; the host array's views and the device tensor's views
    address the same bytes, so one copy of the host array fills the graph's inputs."""
    host = np.zeros(packed_len(bucket), dtype=np.int64)
    rows = decode_inputs(host, bucket)
    rows.input_ids[:] = np.arange(bucket) + 100
    rows.positions[:] = np.arange(bucket) + 200
    rows.slot_mapping[:] = np.arange(bucket) + 300
    rows.context_lens[:] = np.arange(bucket) + 400
    device = torch.from_numpy(host.copy())  # what the copy lands in
    views = decode_inputs(device, bucket)
    assert isinstance(views, DecodeInputs)
    spans = []
    for name, offset in zip(DecodeInputs._fields, (100, 200, 300, 400)):
        view = getattr(views, name)
        assert view.shape == (bucket,) and view.is_contiguous()
        assert view.dtype == (torch.int32 if name == "context_lens" else torch.int64)
        assert torch.equal(view, torch.arange(bucket, dtype=view.dtype) + offset), name
        start = view.data_ptr() - device.data_ptr()
        assert start % 16 == 0, (name, start)
        spans.append((start, start + bucket * view.element_size()))
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= device.numel() * device.element_size()
