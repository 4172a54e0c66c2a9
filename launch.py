"""Start a disaggregated prefill/decode cluster (or a colocated baseline) and serve clients.

    python launch.py --prefill-tp 2 --decode-tp 1            # serve on tcp://127.0.0.1:5555
    python launch.py --prefill-tp 2 --decode-tp 1 --demo     # answer a few prompts, then stop
    python launch.py --config configs/2p1d.yaml --port 6000  # a preset; flags override it

Across machines (README, "Two machines"): the router node opens the cluster to joins,
group nodes join it and leave it while it serves, and ``--status`` lists the groups.

    python launch.py --master-addr 10.0.0.1 --decode-groups 0          # router node (+ a prefill group)
    python launch.py --join 10.0.0.1:29500 --role decode --tp 2        # a group node
    python launch.py --status tcp://10.0.0.1:5555                      # the groups, their load and KV

Ctrl-C, SIGTERM or a closed terminal (SIGHUP) drains in-flight requests and exits 0 (a second
one ends them at once, each with a ``shutdown`` error); on a group node it drains that group and
removes it from the cluster.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import signal
import statistics
import sys
import threading
import time
import typing
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

_interrupted = False  # whether Ctrl-C came while the imports ran, even if one swallowed it


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


signal.signal(signal.SIGINT, _interrupt)
try:
    import click
    import torch

    from pdserve.cluster.config import ClusterConfig, cluster_settings, model_names, parse_devices
    from pdserve.cluster.group import name_process
    from pdserve.cluster.habits import HintedCommand
    from pdserve.cluster.launcher import Cluster, ClusterError, StoppedBeforeReady
    from pdserve.engine.config import SettingSpec
except (ModuleNotFoundError, KeyboardInterrupt) as e:
    if _interrupted:  # Ctrl-C while torch loads: the shell's exit status, not a traceback
        sys.exit(130)
    assert isinstance(e, ModuleNotFoundError)  # run from a checkout that was never installed
    sys.exit(f"error: {e.name} is not installed; run `pip install -e .` in the repository root first")
# torch's C extension imports numpy and drops whatever that import raised, a KeyboardInterrupt
# too, leaving numpy half imported: stop here rather than fail later inside a library.
if _interrupted:
    sys.exit(130)
signal.signal(signal.SIGINT, signal.default_int_handler)

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a graphics card.",
    "In one sentence, why do language models cache keys and values?",
)


def _demo_devices(config: ClusterConfig) -> ClusterConfig:
    """The demo runs on the CPU unless ``--devices`` places it: the README's first command then
    works alike on every machine, whatever GPUs it has (one cannot hold a TP-2 group)."""
    if config.devices is not None or config.master_addr is not None:
        return config
    if torch.cuda.device_count() > 0:
        print("the demo runs on the CPU; --devices places it on GPUs", file=sys.stderr)
    return dataclasses.replace(config, devices=())


def run_demo(endpoint: str, prompts: tuple[str, ...], max_tokens: int, stopped: Callable[[], bool]) -> None:
    """Stream each prompt's answer through the client and print its latencies; once ``stopped()``
    (Ctrl-C), send no further prompt."""
    from pdserve.cluster.client import Chunk, Client

    with Client(endpoint, timeout=600) as client:
        for prompt in prompts:
            if stopped():
                return
            click.echo(f"\n>>> {prompt}")
            started = time.monotonic()
            arrivals: list[float] = []
            for message in client.stream(prompt, max_tokens=max_tokens, temperature=0.0):
                if isinstance(message, Chunk):
                    arrivals.extend([time.monotonic()] * len(message.token_ids))
                    sys.stdout.write(message.text)
                    sys.stdout.flush()
                else:
                    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
                    itl = f"{statistics.mean(gaps) * 1e3:.1f} ms" if gaps else "n/a"
                    ttft = (arrivals[0] - started) * 1e3 if arrivals else float("nan")
                    transfer = message.timings.get("transfer")
                    click.echo(
                        f"\n[{message.usage['prompt_tokens']} prompt + {message.usage['completion_tokens']} "
                        f"generated, {message.finish_reason}] TTFT {ttft:.0f} ms, inter-token {itl} mean"
                        + (f", KV transfer {transfer * 1e3:.1f} ms" if transfer is not None else ""),
                        err=True,
                    )


# A leader reports every fraction of a second between steps: a report older than this is a long step's.
_STALE_REPORT_S = 5.0
_SECTIONS = (
    "Launcher",
    "Model",
    "Topology",
    "Multi-node",
    "Serving",
    "Engine",
    "KV transfer",
    "Fault tolerance",
    "GPU",
)


# What a vLLM user types by habit, and what this command line says instead (added to the error).
_TP_HINT = "Each group has its own degree: --prefill-tp, --decode-tp, --colocated-tp."
_VLLM_HABITS = {
    "serve": "There is no 'serve' subcommand: pdserve --model MODEL, or python launch.py --model MODEL.",
    "--tensor-parallel-size": _TP_HINT,
    "-tp": _TP_HINT,
    "--enable-prefix-caching": "The prefix cache is on by default; --no-prefix-cache turns it off.",
}


# The launcher's own options, which are not settings and have no YAML key.
_LAUNCHER_OPTIONS = ("config", "demo", "demo_max_tokens", "status", "version")


class SectionedCommand(HintedCommand):
    """``--help`` lists the options under their sections, GPU-only ones last; a usage error caused
    by a vLLM habit says what to type instead."""

    habits = _VLLM_HABITS

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {name: [] for name in _SECTIONS}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "section", "Launcher"), []).append(record)
        for name, rows in sections.items():
            if rows:
                with formatter.section(f"{name} options" + (" (used only on GPUs)" if name == "GPU" else "")):
                    formatter.write_dl(rows)


class SettingOption(click.Option):
    def __init__(self, *args: Any, section: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def _parse_devices(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return parse_devices(value)
    except ValueError as e:
        raise click.BadParameter(str(e).split(": ", 1)[1]) from None


def _setting_option(spec: SettingSpec) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One click option per setting. Its default is None ("not given") so that a preset's value
    is overridden only by flags the user typed; the help shows the setting's real default."""
    shown = spec.default_text or ("on" if spec.default is True else "off" if spec.default is False else spec.default)
    help_text = f"{spec.help}  [default: {shown}]"
    kwargs: dict[str, Any] = {"default": None, "help": help_text, "section": spec.section, "cls": SettingOption}
    if spec.type is bool:
        decls = [f"{spec.flag}/--no-{spec.flag[2:]}", spec.key]
    else:
        decls = [spec.flag, spec.key]
        # The hint's one type besides None: `int | None` takes an int.
        value_type = next(t for t in typing.get_args(spec.type) or (spec.type,) if t is not type(None))
        if spec.choices:
            kwargs["type"] = click.Choice(spec.choices)
        elif typing.get_origin(value_type) is tuple:
            kwargs["callback"] = _parse_devices
        else:
            kwargs["type"] = value_type
    return click.option(*decls, **kwargs)


def _as_typed(message: str, given: dict[str, Any], preset: bool) -> str:
    """Name each setting a check's message mentions as the user set it: by its flag where it was
    typed, or where only a flag can change it (no preset); by its key, as the preset spells it,
    where a preset may have set it. Checks name settings both ways."""
    flag_of = {spec.key: spec.flag for spec in cluster_settings()}
    key_of = {flag: key for key, flag in flag_of.items()}

    def alternation(names: Iterable[str]) -> str:
        return "|".join(map(re.escape, sorted(names, key=len, reverse=True)))

    one_word = alternation(k for k in flag_of if "_" not in k)
    # A flag, or a key with an underscore, anywhere as a whole word; a one-word key ("port",
    # "model") only where a check names its setting: leading ("key must ...", "key 7 exceeds")
    # or weighed against ("key (value)"), as other text may use the word.
    pattern = re.compile(  # (not within a path or file name: ".../generation_config.json")
        rf"(?<![\w/-])({alternation(key_of)}|{alternation(k for k in flag_of if '_' in k)})(?![\w-]|\.\w)"
        rf"|^({one_word})(?= must | \(| -?\d)|(?<= )({one_word})(?= \()"
    )

    def rename(match: re.Match[str]) -> str:
        word = next(group for group in match.groups() if group)
        key = key_of.get(word, word)
        return flag_of[key] if key in given or not preset else key

    return pattern.sub(rename, message)


# A preset's keys that are no settings, by what they are instead.
_NOT_SETTINGS = {
    **{key: "a launcher option, not a setting: give it on the command line" for key in _LAUNCHER_OPTIONS},
    "architectures": "a model's shape, not a cluster preset: configs/models/ holds those, for --model NAME",
}


def _unknown_key_hint(message: str) -> str:
    """A preset's unknown key explained where a vLLM habit or a launcher option explains it."""
    match = re.search(r"unknown setting '(\w+)'$", message)
    if match is None:
        return message
    key = match.group(1)
    hint = _NOT_SETTINGS.get(key) or _VLLM_HABITS.get("--" + key.replace("_", "-"))
    return f"{message} ({hint})" if hint else message


def setting_options(function: Callable[..., Any]) -> Callable[..., Any]:
    for spec in reversed(cluster_settings()):
        function = _setting_option(spec)(function)
    return function


@click.command(cls=SectionedCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--config",
    "config_path",
    metavar="PRESET",
    help="A cluster preset: a YAML file (keys as the flags below) or the name of one in configs/ "
    "(1p1d, 2p1d, colocated); flags given here override it.",
)
@click.version_option(package_name="pdserve", prog_name="pdserve")
@click.option("--demo", is_flag=True, help="Answer a few prompts through the client, then shut down.")
@click.option(
    "--demo-max-tokens", type=click.IntRange(min=1), default=48, show_default=True, help="Tokens per demo answer."
)
@click.option(
    "--status",
    "status_endpoint",
    metavar="ENDPOINT",
    help="Print the groups of the running cluster whose client endpoint is ENDPOINT (tcp://HOST:PORT): "
    "role, TP, devices, requests in flight, load and KV use; then exit.",
)
@setting_options
def main(config_path: str | None, demo: bool, demo_max_tokens: int, status_endpoint: str | None, **flags: Any) -> None:
    """Serve a disaggregated prefill/decode cluster (or a colocated baseline) until Ctrl-C."""
    given = {k: v for k, v in flags.items() if v is not None}
    if status_endpoint is not None:
        ignored = sorted(set(given) - {"auth_keys"}) + (["demo"] if demo else []) + (["config"] if config_path else [])
        if ignored:  # else they would be dropped without a word
            named = ", ".join("--" + name.replace("_", "-") for name in ignored)
            raise click.UsageError(f"--status reads a running cluster and takes only --auth-keys, not {named}")
        print_status(status_endpoint, given.get("auth_keys"))
        return
    try:
        config = ClusterConfig.from_preset(config_path, **given) if config_path else ClusterConfig.from_settings(given)
    except (TypeError, ValueError) as e:
        raise click.UsageError(_unknown_key_hint(_as_typed(str(e), given, preset=config_path is not None))) from None
    if config.join is not None:
        if config_path:
            raise click.UsageError("--config applies to the router node: a group node (--join) takes the cluster's")
        if demo:
            raise click.UsageError("--demo runs on the router node: a group node (--join) takes no prompts itself")
        sys.exit(run_group_node(given))
    if demo:
        if "log_stats_interval" not in given:  # its lines would break into the streamed answers
            config = dataclasses.replace(config, log_stats_interval=0.0)
        config = _demo_devices(config)
        if config.http_port is not None:
            print(
                "the demo stops the cluster, its HTTP API too, once it has answered: drop --demo to keep serving",
                file=sys.stderr,
            )
    name_process("pdserve-launch")
    # The router's lines (groups ready, joining, leaving, restarting; refused clients) read as the ranks' do.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s launcher %(levelname)s %(message)s")
    cluster = Cluster(config, require_tokenizer=demo)
    started = time.monotonic()
    try:
        cluster.start()
    except StoppedBeforeReady as e:  # as a stop of a ready cluster: exit 0, not an error
        click.echo(str(e), err=True)
        return
    except (ClusterError, ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(_as_typed(str(e), given, preset=config_path is not None)) from None
    finished = threading.Event()
    demo_failure: list[BaseException] = []

    def serving() -> None:
        click.echo(f"ready in {time.monotonic() - started:.1f} s: {cluster.summary()}", err=True)
        if cluster.http_url is not None:
            model = model_names(config.served_model_name)[0] if config.served_model_name else config.engine.model
            click.echo(f"http {cluster.http_url}/v1 (OpenAI-compatible, model {model!r})", err=True)
        click.echo(f"run directory {cluster.addresses.run_dir}", err=True)
        click.echo(f"endpoint {cluster.endpoint}", err=True)
        if demo:
            threading.Thread(target=demo_thread, daemon=True).start()

    def demo_thread() -> None:
        try:
            run_demo(cluster.endpoint, DEMO_PROMPTS, demo_max_tokens, lambda: cluster.stop_requested)
        except Exception as e:  # reported after the cluster has shut down, with exit status 1
            if not cluster.stop_requested:  # else the answer the user stopped, cut short: no failure
                demo_failure.append(e)
        finally:
            finished.set()

    try:
        cluster.serve(until=finished.is_set, serving=serving)
    except ClusterError as e:
        raise click.ClickException(str(e)) from None
    if demo_failure:
        raise click.ClickException(f"the demo failed: {demo_failure[0]}")
    click.echo("stopped: every process exited cleanly", err=True)


def run_group_node(given: dict[str, Any]) -> int:
    """``--join``: this machine's group joins the cluster, serves until SIGTERM, then leaves it."""
    from pdserve.cluster.join import GroupNode

    name_process("pdserve-node")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node %(levelname)s %(message)s")
    try:
        node = GroupNode(given)
        node.start()
    except (ClusterError, ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None

    def joined() -> None:
        click.echo(f"joined: {node.name} at {node.address}", err=True)

    return node.serve(joined)


def print_status(endpoint: str, auth_keys: str | None) -> None:
    """``--status``: one line per group of the cluster at ``endpoint``."""
    from pdserve.cluster.client import Client, ClusterUnavailable, normalize_endpoint

    try:
        with Client(normalize_endpoint(endpoint), timeout=10, auth_keys=auth_keys) as client:
            stats = client.stats()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--status") from None
    except ClusterUnavailable as e:
        hint = " (--status takes the client endpoint, the router node's --host:--port, not its --master-port)"
        raise click.ClickException(f"{e}{hint}") from None
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    # IN FLIGHT and LOAD are the router's own count, current; RUNNING, WAITING and KV USED are the
    # group's last report, which a leader sends between engine steps: a long step ages it.
    rows = [
        ("GROUP", "ROLE", "TP", "STATE", "DEVICES", "ADDRESS", "IN FLIGHT", "LOAD", "RUNNING", "WAITING", "KV USED")
    ]
    stale = False
    for m in stats.members:
        report = stats.groups.get(f"{m.role}{m.group}", {})
        total, free = report.get("num_blocks", 0), report.get("free_blocks", 0)
        kv = f"{total - free}/{total} ({(total - free) / total:.0%})" if total else "-"
        if m.stats_age is not None and m.stats_age > _STALE_REPORT_S:
            kv += f"  stats {m.stats_age:.0f} s old"
            stale = True
        rows.append(
            (
                f"{m.role}{m.group}" + (" (joined)" if m.joined else ""),
                m.role,
                str(m.tp),
                m.state,
                ",".join(d or "?" for d in m.devices),
                m.address,
                str(m.requests),
                str(m.load),
                str(report.get("running", "-")),
                str(report.get("waiting", "-")),
                kv,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    state = "ready" if stats.ready else "not ready"
    faults = ", ".join(f"{name} {count}" for name, count in stats.faults.items()) or "none"
    click.echo(f"{stats.requests_in_flight} request(s) in flight; {state}; faults: {faults}")
    if stale:
        click.echo(
            "(RUNNING, WAITING, KV USED: a group's last report, sent between engine steps; a long prefill delays it)"
        )


if __name__ == "__main__":
    main()
