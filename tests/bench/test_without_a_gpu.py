"""The GPU benchmarks on a machine without a GPU: one line saying so and how to run on the CPU,
where they used to end in a traceback from ``torch.cuda``."""

from __future__ import annotations

import click
import pytest
import torch
from click.testing import CliRunner

from pdserve.bench import batch_divergence, cluster_check, ipc_transfer


@pytest.mark.parametrize(
    ("command", "args", "needle"),
    [
        (cluster_check.main, [], "--devices 0,1 needs GPUs and none is visible; --devices cpu runs on the CPU"),
        (batch_divergence.main, [], "--device cuda:0 needs a GPU and none is visible; --device cpu runs on the CPU"),
        (
            ipc_transfer.main,
            ["--no-mps"],
            "--devices 0,0 needs a GPU and none is visible; --devices cpu runs on the CPU",
        ),
    ],
    ids=["cluster_check", "batch_divergence", "ipc_transfer"],
)
def test_a_gpu_benchmark_without_a_gpu_says_so(
    command: click.Command, args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU machine, wherever this runs
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output, result.output


def test_the_benchmarks_take_cpu_for_no_gpu_as_launch_does() -> None:
    from pdserve.bench.common import device_list

    assert device_list("cpu") == device_list(" CPU ") == device_list("") == ""
    assert device_list("0,0") == "0,0"
