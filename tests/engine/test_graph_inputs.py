"""The packed inputs of a decode CUDA graph (engine.graph_runner.decode_inputs and the runner's
buffer), checked on CPU: the layout one host-to-device copy fills."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.graph_runner import DecodeInputs, decode_buffer_layout, decode_inputs, pack_decode_step, packed_len
from pdserve.engine.step_plan import StepPlan


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


@pytest.mark.parametrize(("max_bucket", "width"), [(1, 3), (8, 2), (24, 5), (256, 129)])
def test_decode_step_lands_in_the_graph_inputs(max_bucket: int, width: int) -> None:
    """A decode step packed for each bucket and copied as the runner copies it (host at its
    start, the tables into the block tables' corner) leaves the graph's views holding the plan
    and its padding rows; bucket 1 in one copy, its table row right behind its inputs. Every
    region starts 16-byte aligned and none overlaps another."""
    max_blocks, dummy, block_size = 129, 7, 16
    layout = decode_buffer_layout(max_bucket, max_blocks)
    assert layout.one_row_at % 2 == 0 and layout.tables_at % 2 == 0
    assert layout.one_row_at >= packed_len(max_bucket) and layout.tables_at >= layout.one_row_at + packed_len(1)
    buffer = torch.full((layout.size,), -1, dtype=torch.int64)  # what the device holds
    block_tables = buffer[layout.tables_at :].view(torch.int32)[: max_bucket * max_blocks].view(max_bucket, max_blocks)
    for bucket in sorted({1, (max_bucket + 1) // 2, max_bucket}):
        batch = (bucket + 1) // 2
        tables = np.arange(batch * width, dtype=np.int32).reshape(batch, width) + 100
        plan = StepPlan(
            list(range(10, 10 + batch)),
            list(range(20, 20 + batch)),
            list(range(30, 30 + batch)),
            tables,
            list(range(40, 40 + batch)),
            list(range(batch + 1)),
            list(range(batch)),
            True,
        )
        start, host, host_tables = pack_decode_step(plan, bucket, layout, dummy, block_size)
        assert (host_tables is None) == (bucket == 1)
        buffer[start : start + len(host)] = torch.from_numpy(host)
        if host_tables is not None:
            block_tables[:bucket, :width] = torch.from_numpy(host_tables)
        assert start == layout.inputs_at(bucket) == (layout.one_row_at if bucket == 1 else 0)
        views = decode_inputs(buffer[start:], bucket)
        pad = bucket - batch
        assert views.input_ids.tolist() == plan.input_ids + [0] * pad
        assert views.positions.tolist() == plan.positions + [0] * pad
        assert views.slot_mapping.tolist() == plan.slot_mapping + [dummy * block_size] * pad
        assert views.context_lens.tolist() == plan.context_lens + [1] * pad
        assert block_tables[:batch, :width].tolist() == tables.tolist()
        assert block_tables[batch:bucket, :width].tolist() == [[dummy] * width] * pad
