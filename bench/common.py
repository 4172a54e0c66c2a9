"""Helpers shared by the engine benchmarks and the GPU tests.

Step plans built straight on a ``ModelRunner``'s block pool (no scheduler), per-step timing,
run metadata, JSON and plots. A tensor-parallel group to run them in is ``bench.harness``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.presets import ensure_preset_model
from pdserve.engine.step_plan import StepPlan, padded_block_tables

# Device-to-device copy ceiling of one H200 (bytes read + written), measured: docs/benchmarks.md.
H200_BANDWIDTH = 4.29e12


# An on/off benchmark option's choices and the settings each runs, in order.
ON_OFF_BOTH: dict[str, tuple[bool, ...]] = {"both": (False, True), "on": (True,), "off": (False,)}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option's help; the description's lines as written."""


def bench_parser(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``pdserve.bench.<module>``: its docstring's first paragraph (the
    summary, whole) as the description, and each option's default in ``--help``."""
    return argparse.ArgumentParser(
        prog=f"python -m pdserve.bench.{module}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=_HelpFormatter,
    )


def device_list(devices: str) -> str:
    """A benchmark's ``--devices`` as launch.py takes it: ``cpu`` (launch.py's word) or empty for
    the CPU (returned empty), else the GPU ids as given."""
    return "" if devices.strip().lower() == "cpu" else devices


def parse_ints(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``."""
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def add_step_timing_args(parser: argparse.ArgumentParser) -> None:
    """The options every step-timing benchmark shares."""
    parser.add_argument("--iters", default=50, type=int, help="timed calls per measurement (median reported)")
    parser.add_argument("--warmup", default=5, type=int, help="untimed calls before each measurement")
    parser.add_argument("--block-size", default=16, type=int)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--out", type=Path, help="write every number as JSON here")


def parse_step_timing_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def write_json(result: dict[str, Any], path: Path | None) -> None:
    """Write a benchmark's result (when a path was given, as :func:`to_json`) and say where."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_json(result) + "\n")
        print(f"wrote {path}")


def to_json(value: Any, indent: int = 0) -> str:
    """JSON text of ``value``, one item a line for dicts and for lists that hold containers,
    indented by two; a list of plain values on one line. A served request's per-token arrival
    times are hundreds of numbers: at a line each, a serving run's results file grows several
    times over, past what comes back from the GPU host."""
    pad = " " * (indent + 2)
    if isinstance(value, dict) and value:
        # json.dumps of a non-str key gives the key JSON would write ("1", "true", "null")
        items = (
            f"{pad}{json.dumps(key if isinstance(key, str) else json.dumps(key))}: {to_json(item, indent + 2)}"
            for key, item in value.items()
        )
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
        return "[\n" + ",\n".join(pad + to_json(item, indent + 2) for item in value) + "\n" + " " * indent + "]"
    return json.dumps(value)


def pyplot() -> Any | None:
    """``matplotlib.pyplot`` on the file-only Agg backend, or None, with a warning, when
    matplotlib is not installed (plots are optional: ``pip install matplotlib``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed: no plots written (pip install matplotlib)", stacklevel=3)
        return None
    return plt


def log_axis(ax: Any, axis: Any) -> None:
    """A log axis labelled in plain numbers ("1200", not "1.2 x 10^3"), minor ticks only on short ranges."""
    from matplotlib.ticker import LogFormatter

    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log")
    axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
    axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def save_figure(plt: Any, fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` (PNG, 120 dpi) and close it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_dir(preset: str, model: str | None, dtype: str, device: torch.device) -> Path:
    """The checkpoint to benchmark: ``model`` if given, else preset ``preset`` with random weights."""
    if model is not None:
        return Path(model)
    # On a GPU the weights are drawn there: a 7B is seconds instead of minutes.
    return ensure_preset_model(preset, dtype=dtype, device=device.type)


# -- plans on a runner's pool -------------------------------------------------------------


def bit_pattern(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width: bitwise comparisons in which NaN equals itself."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_tables(
    lengths: Sequence[int], block_size: int, num_blocks: int, generator: torch.Generator
) -> list[list[int]]:
    """Distinct pool blocks for sequences of ``lengths`` tokens, in shuffled order (as a busy pool has)."""
    needed = [blocks_for(n, block_size) for n in lengths]
    if sum(needed) > num_blocks:
        raise ValueError(f"{sum(needed)} blocks needed, the pool has {num_blocks}")
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(perm[start : start + n])
        start += n
    return tables


def decode_plan(
    tables: list[list[int]], context_lens: Sequence[int], block_size: int, token_ids: Sequence[int]
) -> StepPlan:
    """One decode step: sequence ``b`` adds its token at position ``context_lens[b] - 1``."""
    positions = [c - 1 for c in context_lens]
    slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(tables, positions)]
    batch = len(tables)
    return StepPlan(
        input_ids=list(token_ids),
        positions=positions,
        slot_mapping=slots,
        block_tables=padded_block_tables(tables),
        context_lens=list(context_lens),
        cu_seqlens_q=list(range(batch + 1)),
        sample_rows=list(range(batch)),
        is_decode=True,
    )


def uniform_decode_plan(
    runner: ModelRunner, token_ids: Sequence[int], context: int, generator: torch.Generator
) -> StepPlan:
    """A decode step of ``len(token_ids)`` sequences of context ``context`` each, in distinct
    shuffled blocks of ``runner``'s pool."""
    tables = block_tables([context] * len(token_ids), runner.block_size, runner.num_blocks, generator)
    return decode_plan(tables, [context] * len(token_ids), runner.block_size, token_ids)


def prefill_plan(
    tables: list[list[int]], prompts: Sequence[Sequence[int]], block_size: int, all_rows: bool = False
) -> StepPlan:
    """Whole prompts in one step; samples each prompt's last token, or every token if ``all_rows``."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    for table, prompt in zip(tables, prompts):
        input_ids.extend(prompt)
        positions.extend(range(len(prompt)))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(len(prompt)))
        cu_seqlens.append(cu_seqlens[-1] + len(prompt))
    rows = list(range(cu_seqlens[-1])) if all_rows else [end - 1 for end in cu_seqlens[1:]]
    return StepPlan(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        block_tables=padded_block_tables(tables),
        context_lens=[len(p) for p in prompts],
        cu_seqlens_q=cu_seqlens,
        sample_rows=rows,
        is_decode=False,
    )


def fill_kv_random(runner: ModelRunner, seed: int = 0) -> None:
    """Standard-normal K/V in every pool block but the dummy one (which stays zero, as graph
    padding expects): attention then reads real-looking data, never a zero fast path.

    On CUDA the fill is one replay of a captured graph: an eager PyTorch kernel over gigabytes of
    the pool, run after the runner captured its graphs, slows every later launch of those graphs
    for the rest of the process, a state no server is in (docs/decisions.md, "CUDA graphs")."""
    pool = runner.kv_cache[:, :, : runner.num_blocks]
    if runner.device.type != "cuda":
        pool.normal_(generator=torch.Generator(device=runner.device).manual_seed(seed))
        return
    with torch.random.fork_rng(devices=[runner.device]):
        torch.cuda.manual_seed(seed)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pool.normal_()
        graph.replay()
        torch.cuda.synchronize(runner.device)


def teacher_forced_logits(runner: ModelRunner, prompt: Sequence[int]) -> torch.Tensor:
    """fp32 logits ``[len(prompt), vocab]`` (on CPU) of one prefill of ``prompt`` in pool blocks
    0, 1, ...: the prediction after every prefix, as a teacher-forced comparison needs."""
    tables = [list(range(blocks_for(len(prompt), runner.block_size)))]
    logits = runner.step(prefill_plan(tables, [prompt], runner.block_size, all_rows=True))
    assert logits is not None
    return logits.float().cpu()


@dataclass
class Divergence:
    """Where an output first departs from the reference, with the reference's view of that step
    (its logits teacher-forced over the prompt and the common prefix)."""

    request: int
    step: int
    got: int
    want: int
    top_ids: list[int]  # the reference's three best tokens there, best first
    top_logits: list[float]
    got_logit: float  # the reference's logit for the token the output took

    @property
    def near_tie(self) -> bool:
        """A rounding difference can only flip a near-tie, which leaves the other token second,
        or level with the second (the reference's order among equal logits is arbitrary)."""
        return self.got in self.top_ids[:2] or self.got_logit >= self.top_logits[1]

    @property
    def gap(self) -> float:
        """How far below the reference's best token the output's token scored (logits)."""
        return self.top_logits[0] - self.got_logit

    @property
    def bf16_steps(self) -> float:
        """``gap`` in units of bf16's spacing at the best logit (8 significant bits)."""
        best = abs(self.top_logits[0])
        spacing = 2.0 ** (math.floor(math.log2(best)) - 7) if best > 0 else 2.0**-133
        return self.gap / spacing

    def as_dict(self) -> dict[str, Any]:
        """Every field, plus ``gap`` and ``near_tie``: a benchmark's JSON record."""
        return {**vars(self), "gap": self.gap, "bf16_steps": self.bf16_steps, "near_tie": self.near_tie}

    def describe(self) -> str:
        top = ", ".join(f"{t}: {v:.3f}" for t, v in zip(self.top_ids, self.top_logits))
        return (
            f"request {self.request}: token {self.got} at step {self.step} (logit {self.got_logit:.3f}, "
            f"{self.gap:.3f} below the best), reference top-3 {{{top}}}"
        )


def divergences(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]
) -> list[Divergence]:
    """The first divergence of every output of ``got`` that differs from ``want`` in a token
    (outputs that only differ in length are left to the caller)."""
    found = []
    for i, (prompt, a, b) in enumerate(zip(prompts, got, want)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            continue
        logits = teacher_forced_logits(runner, [*prompt, *b[:k]])[-1]
        top = logits.topk(3)
        found.append(Divergence(i, k, a[k], b[k], top.indices.tolist(), top.values.tolist(), logits[a[k]].item()))
    return found


def compare_greedy(
    runner: ModelRunner, prompts: Sequence[Sequence[int]], got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]
) -> tuple[int, list[str]]:
    """Greedy outputs ``got`` against the reference ``want`` that ``runner``'s engine produced:
    :func:`greedy_report` of their :func:`divergences`."""
    return greedy_report(got, want, divergences(runner, prompts, got, want))


def greedy_report(
    got: Sequence[Sequence[int]], want: Sequence[Sequence[int]], found: Sequence[Divergence]
) -> tuple[int, list[str]]:
    """The number of identical outputs, and a line for every output that differs in length or
    first diverges to a token the reference does not rank first or second (not a near-tie,
    see :class:`Divergence`); ``found`` are the divergences of ``got`` from ``want``."""
    identical = sum(list(a) == list(b) for a, b in zip(got, want))
    bad = [
        f"request {i}: {len(a)} tokens against {len(b)}"
        for i, (a, b) in enumerate(zip(got, want))
        if len(a) != len(b) and list(a[: len(b)]) == list(b[: len(a)])
    ]
    bad += [d.describe() for d in found if not d.near_tie]
    return identical, bad


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of this rank's parameters (tied embeddings count once): what one decode step reads."""
    return sum(p.numel() * p.element_size() for p in runner.model.parameters())


def kv_bytes_per_token(runner: ModelRunner) -> int:
    """Bytes of K and V per token on this rank, all layers."""
    return runner.block_bytes // runner.block_size


# -- timing ---------------------------------------------------------------------------------


def time_steps(fn: Callable[[], Any], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` after ``warmup`` untimed ones.

    On CUDA each call sits between two events on the current stream, so a call's time is what
    the GPU spent from its first to its last kernel, idle gaps (host overhead the GPU waited
    for) included; on CPU it is wall time.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start_event, end_event in events:
        start_event.record()
        fn()
        end_event.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def time_once(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``: between two events on the current stream on CUDA
    (its kernels and the launch gaps between them), wall time on CPU."""
    if device.type != "cuda":
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def summary(times_ms: Sequence[float]) -> dict[str, float]:
    """Median (the reported number), min and max of per-call times."""
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms)}


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """How this run was started: the process's own command line, or ``module`` called with ``argv``."""
    return " ".join(sys.orig_argv) if argv is None else " ".join(["python", "-m", module, *argv])


def metadata(device: torch.device, command: str, **extra: Any) -> dict[str, Any]:
    """Date, host, versions and command line of this run."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "gpu_count": torch.cuda.device_count() if device.type == "cuda" else 0,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "command": command,
        **extra,
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool = False, labels: int = 1) -> str:
    """Plain text or Markdown; the first ``labels`` columns left-aligned, the numbers right-aligned."""
    if markdown:
        rule = ["---"] * labels + ["---:"] * (len(headers) - labels)
        return "\n".join("| " + " | ".join(cells) + " |" for cells in (headers, rule, *rows))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
