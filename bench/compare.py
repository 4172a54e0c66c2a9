"""Disaggregated prefill/decode against colocated serving on the same devices, one workload.

    python -m pdserve.bench.compare --model qwen2.5-1.5b --devices 0,1 --workload mixed --rates 4,8,16,32 \\
        --num-requests 160 --isolated-decode --slo-ttft-ms 500 --out-dir results/pd-vs-colocated
    python -m pdserve.bench.compare --model qwen2.5-1.5b --devices 0,1,2 --prefill-tp 2 --workload mixed ...  # 2p1d
    python -m pdserve.bench.compare --model demo --devices cpu --workload text --num-requests 6 --rates 2   # CPU
    python -m pdserve.bench.compare --model qwen2.5-1.5b --devices 0,0 --systems disagg,colocated-chunked \\
        --prefill-sm-percent 60 --decode-sm-percent 40 --workload mixed ...           # PD on one GPU, SM split

Three clusters run one after another, each ``launch.py`` in a subprocess on a free port with its
log in OUT_DIR/<system>.log, stopped with SIGTERM and required to exit 0:

* ``disagg``: one prefill group of ``--prefill-tp`` ranks and one decode group of ``--decode-tp``
  (default 1 and 1), KV over ``--transfer`` (auto: cuda-ipc on GPUs, gloo on CPU); with
  ``--devices 0,0`` both groups share one GPU, each with half its memory and, with
  ``--prefill-sm-percent`` / ``--decode-sm-percent``, a share of its SMs through CUDA MPS;
* ``colocated-chunked``: ``configs/colocated.yaml``, one colocated group of TP 1 per distinct
  device of the disaggregated system (two for 1p1d, three for 2p1d, one for ``0,0``) with
  chunked prefill (decodes and prompt chunks share a 2048-token step budget), least-tokens
  dispatch;
* ``colocated-no-chunk``: the same with ``--no-enable-chunked-prefill`` (a prompt is prefilled whole,
  in a step of its own, while the group's decodes wait).

``--systems`` runs a subset; ``--launch-args`` adds launch.py arguments to every one (e.g.
``--launch-args '--leader-spin-ms 0'``; not those compare sets itself). Each gets the same
requests at the same arrival times (``bench.serve``'s options). Written to OUT_DIR:
``<system>.json`` (bench.serve's results), ``report.md`` (the three side by side, plots
embedded) and the PNG plots. ``--devices cpu`` (or empty) runs on CPU (hidden GPUs). With
``--isolated-decode`` the first cluster first serves single requests of ``--input-len`` prompt
tokens alone (one warm-up, then three), and the TPOT SLO of goodput becomes 3x their median
TPOT: the isolated batch-1 decode step. ``--replot`` rebuilds the report and plots from the JSON
files of an earlier run. ``--max-model-len`` (default: what the requests need)
is also the clusters' maximum model length.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import click

from pdserve.bench.common import device_list, format_table, write_json
from pdserve.bench.metrics import tpot
from pdserve.bench.serve import (
    TABLE_HEADERS,
    BenchConfig,
    RequestSpec,
    config_from_options,
    failure_summary,
    load_options,
    longest,
    metrics_row,
    point_requests,
    rate_label,
    results_table,
    run_benchmark,
    run_requests,
    workload_requests,
    write_plots,
)
from pdserve.cluster.client import AsyncClient
from pdserve.cluster.group import free_port
from pdserve.engine.presets import resolve_model

REPO = Path(__file__).resolve().parent.parent
ISOLATED_RUNS = 3
TPOT_SLO_FACTOR = 3.0
# Tokens a chat template adds around a text prompt, at most (SmolLM2's adds about 30).
CHAT_TEMPLATE_TOKENS = 64


class LaunchError(RuntimeError):
    pass


_Process = TypeVar("_Process", bound="LoggedProcess")


class LoggedProcess:
    """A subprocess whose output goes to ``log_path`` (a file, not a pipe: nobody reads a pipe
    while it runs). ``stop()`` sends SIGTERM and returns the exit code; leaving the ``with``
    block kills it if still running."""

    log_path: Path
    proc: subprocess.Popen[bytes]

    def start(self, command: list[str], log_path: Path, env: dict[str, str] | None) -> None:
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 300.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self: _Process) -> _Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class LaunchedCluster(LoggedProcess):
    """``launch.py ARGS`` in a subprocess on a free port, its output in ``log_path``; started on
    construction (returns once the ``endpoint`` line is logged)."""

    def __init__(
        self, args: list[str], log_path: Path, env: dict[str, str] | None = None, start_timeout: float = 900.0
    ) -> None:
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.command = [sys.executable, "launch.py", "--port", str(self.port), *args]
        self.start(self.command, log_path, env)
        deadline = time.monotonic() + start_timeout
        while "endpoint " not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise LaunchError(f"cluster did not start ({' '.join(self.command)}):\n{self.output()[-4000:]}")
            time.sleep(0.2)


# launch.py options that bench.compare sets itself, and what sets each instead: mostly its own
# option of the same name.
_COMPARE_SETS = {
    **{
        flag: f"its {flag}"
        for flag in (
            "--model",
            "--max-model-len",
            "--num-blocks",
            "--devices",
            "--prefill-tp",
            "--decode-tp",
            "--transfer",
            "--prefill-sm-percent",
            "--decode-sm-percent",
        )
    },
    "--port": "a free port it picks",
    **dict.fromkeys(
        (
            "--config",
            "--mode",
            "--colocated-groups",
            "--colocated-tp",
            "--enable-chunked-prefill",
            "--no-enable-chunked-prefill",
        ),
        "the system (--systems)",
    ),
}


def extra_launch_args(launch_args: str) -> list[str]:
    """``--launch-args`` split as a shell would; refused if it sets what bench.compare sets itself,
    which would change a system without its name saying so."""
    try:
        args = shlex.split(launch_args)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--launch-args") from None
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in _COMPARE_SETS:
            raise click.BadParameter(
                f"{flag} is bench.compare's to set: {_COMPARE_SETS[flag]} does", param_hint="--launch-args"
            )
    return args


def system_args(
    devices: int, prefill_tp: int = 1, decode_tp: int = 1, transfer: str = "auto", sm_args: tuple[str, ...] = ()
) -> dict[str, list[str]]:
    """launch.py arguments of each compared system: disaggregated with a prefill group of
    ``prefill_tp`` ranks and a decode group of ``decode_tp``, and colocated with one tp-1 group per
    distinct device (``devices``) those two groups use, so both get the same GPUs."""
    colocated = [
        "--config",
        "configs/colocated.yaml",
        "--mode",
        "colocated",
        "--colocated-groups",
        str(devices),
        "--colocated-tp",
        "1",
    ]
    return {
        "disagg": [
            "--prefill-tp",
            str(prefill_tp),
            "--decode-tp",
            str(decode_tp),
            "--transfer",
            transfer,
            *sm_args,
        ],
        "colocated-chunked": colocated,
        "colocated-no-chunk": [*colocated, "--no-enable-chunked-prefill"],
    }


def isolated_spec(config: BenchConfig, index: int = 0) -> RequestSpec:
    """The ``index``-th isolated-decode request: ``input_len`` random tokens, ``output_len`` tokens
    out; a prompt of its own (a seed the workload's requests never use), so that none finds
    another's KV in the prefix cache, nor a workload request the isolated one's."""
    rng = random.Random(f"isolated/{config.seed}/{index}")
    return RequestSpec(
        "isolated", config.output_len, token_ids=[rng.randrange(config.vocab_size) for _ in range(config.input_len)]
    )


def required_model_len(specs: list[RequestSpec], model_limit: int) -> int:
    """A max model length that fits every request, rounded up to 256, at most ``model_limit``.

    Text prompts are bounded by their characters (a token is at least one character of this
    ASCII prompt file) plus the chat template. A multi-turn request is sent after its session's
    history: the earlier turns' prompts and (``max_tokens`` long) answers."""
    history: dict[int, int] = {}
    longest = 0
    for s in specs:
        prompt = len(s.token_ids) if s.token_ids is not None else len(s.prompt or "") + CHAT_TEMPLATE_TOKENS
        if s.session is not None:
            prompt += history.get(s.session, 0)
            history[s.session] = prompt + s.max_tokens
        longest = max(longest, prompt + s.max_tokens)
    return min(-(-longest // 256) * 256, model_limit)


async def measure_isolated_tpot(endpoint: str, config: BenchConfig) -> list[float]:
    """TPOT (s) of each measured isolated request, sent one at a time after one warm-up."""
    client = AsyncClient(endpoint, timeout=config.timeout)
    try:
        records = await run_requests(
            client,
            [isolated_spec(config, i) for i in range(1 + ISOLATED_RUNS)],
            None,
            1,
            config.seed,
            "isolated decode",
        )
    finally:
        client.close()
    failed = [r.error or r.finish_reason for r in records if not r.ok]
    if failed:
        raise click.ClickException(f"isolated decode request failed: {failed[0]}")
    return [t for t in map(tpot, records[1:]) if t is not None]


def describe_workload(config: BenchConfig) -> str:
    lengths = f"{config.input_len} in / {config.output_len} out ({config.len_dist})"
    text_most = (
        f"{config.output_len} tokens"
        if config.len_dist == "fixed"
        else f"a {config.len_dist} draw of mean {config.output_len} tokens (at most "
        f"{longest(config.output_len, config.len_dist)})"
    )
    detail = {
        "random": lengths,
        "mixed": f"short {lengths}; {config.long_fraction:.0%} long prompts of {config.long_len[0]}-"
        f"{config.long_len[1]} tokens",
        "shared-prefix": f"{config.num_prefixes} prefixes of {config.prefix_len} tokens + questions of {lengths}",
        "multi-turn": f"sessions of {config.num_turns} turns: {config.prefix_len} tokens, then the answer + {lengths}",
        "text": f"prompts of {Path(config.prompts_file).name}, out until EOS or {text_most}",
    }[config.workload]
    load = f"rates {', '.join(rate_label(r) for r in config.rates)} req/s"
    if config.concurrency is not None:
        load += f", at most {config.concurrency} in flight"
    return f"{config.workload}: {detail}; {config.num_requests} requests per rate (+{config.warmup} warm-up), {load}"


def comparison_table(results: dict[str, dict[str, Any]], kind: str | None = None) -> str:
    """Markdown: a row per (rate, system), the systems of one rate next to each other."""
    names = list(results)
    rows = []
    for i, point in enumerate(results[names[0]]["points"]):
        for name in names:
            other = results[name]["points"][i]
            metrics = other["metrics"] if kind is None else other["by_kind"][kind]
            rows.append([rate_label(point["rate"], point["concurrency"]), name, *metrics_row(metrics)])
    return format_table((TABLE_HEADERS[0], "system", *TABLE_HEADERS[1:]), rows, markdown=True, labels=2)


def write_report(out_dir: Path, results: dict[str, dict[str, Any]], setup: dict[str, Any], plots: list[Path]) -> Path:
    """``report.md``: setup, the comparison tables, the plots, the files."""
    config = next(iter(results.values()))["config"]
    slos = [
        f"{name} <= {config[f'slo_{name.lower()}_ms']:.1f} ms"
        for name in ("TTFT", "TPOT")
        if config[f"slo_{name.lower()}_ms"] is not None
    ]
    lines = [
        "# Disaggregated prefill/decode against colocated serving",
        "",
        f"- date: {setup['date']}, host: {setup['host']}",
        f"- command: `{setup['command']}`",
        f"- model: {setup['model']} on {setup['devices']}, max model length {setup['max_model_len']}",
        f"- workload: {setup['workload']}",
        f"- goodput SLOs: {', '.join(slos) if slos else 'none given (no goodput)'}",
    ]
    if setup.get("isolated_tpot_ms") is not None:
        samples = ", ".join(f"{t:.2f}" for t in setup["isolated_tpot_samples_ms"])
        lines.append(
            f"- isolated batch-1 decode TPOT (on {setup.get('isolated_system', next(iter(setup['systems'])))}): "
            f"{setup['isolated_tpot_ms']:.2f} ms "
            f"(median of {samples}); the TPOT SLO is {TPOT_SLO_FACTOR:g}x that"
        )
    lines += ["", "Systems (`launch.py` arguments besides the model, devices, port and lengths):", ""]
    lines += [f"- `{name}`: `{' '.join(args)}`" for name, args in setup["systems"].items()]
    lines += [
        "",
        "## All requests",
        "",
        "Latencies in ms (client-side), throughput and goodput in req/s, tok/s = output tokens/s, "
        "xfer mean = mean KV transfer (ms), xfer KiB its mean size. Definitions: `bench/metrics.py`.",
        "",
        comparison_table(results),
    ]
    warnings = [
        f"- {name}, {line}" for name, r in results.items() for line in failure_summary(r["points"], r.get("warmup", ()))
    ]
    if warnings:
        lines += ["", "Failed requests:", "", *warnings]
    for kind in next(iter(results.values()))["points"][0]["by_kind"]:
        lines += ["", f"## {kind} requests only", "", comparison_table(results, kind)]
    lines += ["", "## Plots", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots] or ["No plots: matplotlib is not installed."]
    lines += ["", "## Files", ""]
    lines += [f"- `{name}.json` (every request's record), `{name}.log` (the cluster's log)" for name in results]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--model", default="demo", help="'demo', a shape preset (random weights) or a HF directory.")
@click.option(
    "--devices",
    default="",
    help="GPU ids, prefill-tp + decode-tp of them (e.g. 0,1, or 0,0 to share one); cpu (or empty): CPU.",
)
@click.option("--prefill-tp", type=int, default=1, help="Ranks of the disaggregated prefill group.")
@click.option("--decode-tp", type=int, default=1, help="Ranks of the disaggregated decode group.")
@click.option("--transfer", default="auto", help="KV transfer backend of the disaggregated system.")
@click.option("--prefill-sm-percent", type=int, default=None, help="SM share of the prefill ranks (CUDA MPS).")
@click.option("--decode-sm-percent", type=int, default=None, help="SM share of the decode ranks (CUDA MPS).")
@click.option(
    "--systems", default=None, help="Comma-separated subset of disagg, colocated-chunked, colocated-no-chunk."
)
@click.option("--launch-args", default="", help="More launch.py arguments for every system, as one quoted string.")
@load_options
@click.option("--num-blocks", type=int, default=None, help="Fixed KV blocks per rank [default: sized from memory].")
@click.option(
    "--isolated-decode",
    is_flag=True,
    help=f"Measure the isolated batch-1 decode TPOT first; the TPOT SLO becomes {TPOT_SLO_FACTOR:g}x it.",
)
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("compare-results"))
@click.option("--start-timeout", type=float, default=900.0, help="Seconds to wait for each cluster to start.")
@click.option(
    "--replot",
    is_flag=True,
    help="Run nothing: rebuild report.md and the plots from OUT_DIR's JSON files (e.g. on a machine "
    "with matplotlib, after a run on one without).",
)
def main(
    model: str,
    devices: str,
    prefill_tp: int,
    decode_tp: int,
    transfer: str,
    prefill_sm_percent: int | None,
    decode_sm_percent: int | None,
    systems: str | None,
    launch_args: str,
    num_blocks: int | None,
    isolated_decode: bool,
    out_dir: Path,
    start_timeout: float,
    replot: bool,
    **options: Any,
) -> None:
    """Run one workload against a disaggregated and two colocated clusters; write a report."""
    if replot:
        paths = [out_dir / f"{name}.json" for name in system_args(devices=1)]
        found = {path.stem: json.loads(path.read_text()) for path in paths if path.exists()}
        if not found:
            raise click.ClickException(f"no results JSON in {out_dir}")
        setup = next(iter(found.values()))["setup"]
        order = [name for name in setup["systems"] if name in found]  # the order they ran in
        results = {name: found[name] for name in order + [n for n in found if n not in order]}
        publish(out_dir, results, setup)
        return
    device_ids = [d.strip() for d in device_list(devices).split(",") if d.strip()]
    if prefill_tp < 1 or decode_tp < 1:
        raise click.UsageError("--prefill-tp and --decode-tp must be >= 1")
    if device_ids and len(device_ids) != prefill_tp + decode_tp:
        raise click.UsageError(
            f"--devices: both systems use prefill-tp + decode-tp = {prefill_tp + decode_tp} GPUs, "
            f"{len(device_ids)} given (or none: CPU)"
        )
    model_dir = resolve_model(model)
    hf_config = json.loads((model_dir / "config.json").read_text())
    config = config_from_options(vocab_size=int(hf_config["vocab_size"]), **options)
    if isolated_decode and config.slo_tpot_ms is not None:
        raise click.UsageError("--isolated-decode sets the TPOT SLO: drop --slo-tpot-ms")
    if isolated_decode and config.output_len < 2:
        raise click.UsageError("--isolated-decode needs --output-len >= 2 (TPOT is the time per token after the first)")
    if config.max_model_len is None:
        # Every rate's requests (each draws its own), the warm-up's and the isolated one.
        warmup, measured = workload_requests(config)
        groups = [
            warmup,
            *(point_requests(config, measured, i) for i in range(len(config.rates))),
            [isolated_spec(config)],
        ]
        needed = max(required_model_len(g, hf_config["max_position_embeddings"]) for g in groups if g)
        config = dataclasses.replace(config, max_model_len=needed)
    common = ["--model", str(model_dir), "--max-model-len", str(config.max_model_len)]
    if num_blocks is not None:
        common += ["--num-blocks", str(num_blocks)]
    extra = extra_launch_args(launch_args)
    env = dict(os.environ)
    if device_ids:
        common += ["--devices", ",".join(device_ids)]
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # CPU even on a GPU machine
    sm_args: list[str] = []
    for flag, value in (("--prefill-sm-percent", prefill_sm_percent), ("--decode-sm-percent", decode_sm_percent)):
        if value is not None:
            sm_args += [flag, str(value)]
    every = system_args(len(set(device_ids)) or prefill_tp + decode_tp, prefill_tp, decode_tp, transfer, tuple(sm_args))
    chosen = systems.split(",") if systems else list(every)
    unknown = sorted(set(chosen) - set(every))
    if unknown:
        raise click.UsageError(f"--systems: unknown {', '.join(unknown)}; choose from {', '.join(every)}")
    systems_run = {name: [*every[name], *extra] for name in chosen}
    setup: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": os.uname().nodename,
        "command": shlex.join(sys.orig_argv),
        "model": f"{model} ({model_dir})",
        "devices": f"GPUs {','.join(device_ids)}" if device_ids else "CPU",
        "max_model_len": config.max_model_len,
        "workload": describe_workload(config),
        "systems": systems_run,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name, args in systems_run.items():
        click.echo(f"== {name}: starting launch.py {' '.join(args)} (log: {out_dir / f'{name}.log'})", err=True)
        try:
            with LaunchedCluster([*common, *args], out_dir / f"{name}.log", env, start_timeout) as cluster:
                if isolated_decode and not results:
                    samples = asyncio.run(measure_isolated_tpot(cluster.endpoint, config))
                    isolated = statistics.median(samples)
                    setup["isolated_system"] = name
                    setup["isolated_tpot_ms"] = isolated * 1e3
                    setup["isolated_tpot_samples_ms"] = [t * 1e3 for t in samples]
                    config = dataclasses.replace(config, slo_tpot_ms=TPOT_SLO_FACTOR * isolated * 1e3)
                    click.echo(
                        f"isolated decode TPOT {isolated * 1e3:.2f} ms: TPOT SLO {config.slo_tpot_ms:.2f} ms", err=True
                    )
                results[name] = asyncio.run(run_benchmark(config, cluster.endpoint))
                code = cluster.stop()
        except LaunchError as e:
            raise click.ClickException(str(e)) from None
        if code != 0:
            raise click.ClickException(f"{name} exited with code {code}; log: {cluster.log_path}")
        results[name]["setup"] = setup
        write_json(results[name], out_dir / f"{name}.json")
        click.echo(f"{name}:\n{results_table(results[name]['points'])}")
    publish(out_dir, results, setup)


def publish(out_dir: Path, results: dict[str, dict[str, Any]], setup: dict[str, Any]) -> None:
    """The plots and report.md of ``results`` in ``out_dir``."""
    plots = write_plots({name: r["points"] for name, r in results.items()}, out_dir)
    click.echo(f"report: {write_report(out_dir, results, setup, plots)}")


if __name__ == "__main__":
    main()
