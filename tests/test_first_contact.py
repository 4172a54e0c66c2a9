"""A newcomer's mistakes with launch.py and the client: one clear line and a non-zero exit,
before any rank starts."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve.cluster.client import normalize_endpoint
from pdserve.cluster.config import ClusterConfig, cluster_settings
from pdserve.cluster.group import free_port
from pdserve.engine.config import ModelConfig

REPO = Path(__file__).resolve().parents[1]


def launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """launch.py with ``args``, on a free port unless they name one: a cluster left running on
    the default port must not turn each mistake below into "address already in use"."""
    port = [] if "--port" in args or "--status" in args else ["--port", str(free_port())]
    return subprocess.run(
        [sys.executable, "launch.py", *args, *port], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def launch_stopped(
    *args: str, at: Callable[[str], bool], stop: int = signal.SIGINT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """launch.py with ``args``, sent ``stop`` (Ctrl-C as from a terminal) at the first line of its
    stderr that ``at`` accepts; its exit status and all of its stderr."""
    process = subprocess.Popen(
        [sys.executable, "launch.py", *args],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stderr is not None
    lines = []
    try:
        for line in process.stderr:
            lines.append(line)
            if at(line):
                process.send_signal(stop)
                break
        _, rest = process.communicate(timeout=120)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, "", "".join(lines) + rest)


def client(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.cluster.client", *args], cwd=REPO, input=stdin, capture_output=True, timeout=60
    )
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(), result.stderr.decode())


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit status non-zero, no traceback, no rank started, and the error in one line."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr and not re.search(r"ready in \d", result.stderr), result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def assert_stopped_before_ready(result: subprocess.CompletedProcess[str], line: str) -> None:
    """Exit status 0, no traceback, no error, and ``line`` the last of stderr."""
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Error" not in result.stderr, result.stderr
    assert result.stderr.splitlines()[-1] == line, result.stderr


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_port_in_use(flag: str, busy_port: int, demo_model_dir: Path) -> None:
    result = launch("--model", str(demo_model_dir), flag, str(busy_port))
    error = assert_one_line_error(result, f"127.0.0.1:{busy_port}")
    assert error.endswith(f"choose another {flag})"), error
    assert len(result.stderr.splitlines()) <= 2, result.stderr


def test_a_host_not_of_this_machine_is_not_taken_for_a_busy_port(demo_model_dir: Path) -> None:
    """It was told "another pdserve running? choose another --port"."""
    error = assert_one_line_error(launch("--model", str(demo_model_dir), "--host", "192.0.2.1"), "192.0.2.1:")
    assert error.endswith("(192.0.2.1 is not an address of this machine)"), error


def test_a_wrong_model_is_named_before_a_busy_port(busy_port: int, tmp_path: Path) -> None:
    """Both mistakes at once: the model's is said first (checked without converting or writing
    anything), not the port's, which would only lead to the second error after a fix."""
    result = launch("--model", str(tmp_path / "missing"), "--port", str(busy_port))
    assert_one_line_error(result, "missing", "nor a directory")


def test_missing_keys_are_named_before_anything_starts(demo_model_dir: Path, tmp_path: Path, busy_port: int) -> None:
    """--auth-keys without the router's keys, or (with --http-port) without the pair the front end
    connects with: one line naming the file and the command that makes it. The front end used to
    fail at its start-up with a FileNotFoundError traceback, after the ranks had loaded."""
    from pdserve.cluster.auth import generate_keys

    keys = generate_keys(tmp_path / "keys", "alice")  # no pair named 'client'
    missing = tmp_path / "none"
    for args, needles in (
        (["--auth-keys", str(missing)], (f"{missing}/server.key_secret not found", "pdserve.cluster.auth")),
        (["--auth-keys", str(keys)], ()),  # the router needs no client's pair: on to the busy --port
        (
            ["--auth-keys", str(keys), "--http-port", "8000"],
            ("front end connects as 'client'", f"pdserve.cluster.auth {keys} --client client"),
        ),
    ):
        result = launch("--model", str(demo_model_dir), "--port", str(busy_port), *args)
        assert_one_line_error(result, *(needles or (f"cannot listen on 127.0.0.1:{busy_port}",)))
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.router.openai_server", "--auth-keys", str(keys)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(result, f"{keys}/clients/client.key_secret not found", "--client client")


def test_the_launchers_log_lines_carry_a_time_as_the_ranks_do(tmp_path: Path) -> None:
    """The router node's own lines (here: the warning that the endpoint is open to the network)
    are stamped like the ranks' lines, not bare text between them."""
    result = launch("--host", "0.0.0.0", "--port", str(free_port()), "--model", str(tmp_path / "missing"))
    warning = next(line for line in result.stderr.splitlines() if "WARNING" in line)
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} launcher WARNING ", warning), result.stderr
    assert_one_line_error(result, "missing")


def test_tp_beyond_the_heads(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["tiny-llama"]
    heads = ModelConfig.from_pretrained(model_dir).num_heads
    result = launch("--model", str(model_dir), "--prefill-tp", str(heads + 1))
    assert_one_line_error(result, f"--prefill-tp {heads + 1}", str(heads))


def test_max_model_len_beyond_the_model(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["tiny-llama"]
    limit = ModelConfig.from_pretrained(model_dir).max_position_embeddings
    result = launch("--model", str(model_dir), "--max-model-len", str(limit + 1))
    assert_one_line_error(result, f"--max-model-len {limit + 1} exceeds", str(limit), "leave it out")


def test_an_empty_model_is_named_as_such() -> None:
    """Not "model directory . has no config.json" ("" is the current directory as a path)."""
    assert_one_line_error(launch("--model", ""), "model is empty: 'demo', a preset")


def test_a_pool_too_small_for_one_sequence(tiny_model_dirs: dict[str, Path]) -> None:
    result = launch("--model", str(tiny_model_dirs["tiny-llama"]), "--num-blocks", "3", "--max-model-len", "64")
    assert_one_line_error(result, "--num-blocks 3 holds 48 tokens", "fewer than --max-model-len 64")


def test_a_model_directory_without_weights(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    for config_file in tiny_model_dirs["tiny-llama"].glob("*.json"):
        (tmp_path / config_file.name).write_bytes(config_file.read_bytes())
    result = launch("--model", str(tmp_path))
    assert_one_line_error(result, f"no *.safetensors files in {tmp_path}")


def test_a_broken_checkpoint_is_named_in_one_line(tiny_model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A truncated download, a checkpoint missing a tensor or holding another model's, or a
    hand-edited config.json gave a traceback from every rank (or the launcher's KeyError), or a
    JSON error that named no file."""
    from safetensors.torch import load_file, save_file

    source = tiny_model_dirs["tiny-llama"]
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    [weights] = tmp_path.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:-100])  # cut short
    assert_one_line_error(launch("--model", str(tmp_path)), f"{weights} is not a readable safetensors file")
    tensors = load_file(next(source.glob("*.safetensors")))
    down = tensors.pop("model.layers.1.mlp.down_proj.weight")
    save_file(tensors, weights)
    assert_one_line_error(launch("--model", str(tmp_path)), "lacks 1 tensors", "model.layers.1.mlp.down_proj.weight")
    save_file(
        {**tensors, "model.layers.1.mlp.down_proj.weight": down, "model.vision_tower.proj": down.clone()}, weights
    )
    assert_one_line_error(launch("--model", str(tmp_path)), "'model.vision_tower.proj'", "matches no parameter")
    weights.write_bytes(next(source.glob("*.safetensors")).read_bytes())
    config = tmp_path / "config.json"
    shape = json.loads(config.read_text())
    for key, value, tensors in [  # the first of the tensors it changes is named
        ("vocab_size", shape["vocab_size"] + 8, r"embed_tokens|lm_head"),
        ("intermediate_size", shape["intermediate_size"] * 2, r"(gate|up|down)_proj"),  # gate and up: fused shards
        ("num_key_value_heads", shape["num_key_value_heads"] // 2, r"(k|v)_proj"),
    ]:
        config.write_text(json.dumps({**shape, key: value}))
        error = assert_one_line_error(launch("--model", str(tmp_path)), f"{config} makes it", "not this checkpoint's")
        assert re.search(rf"checkpoint tensor '[\w.]*({tensors})\.weight'", error), error
    config.write_text(json.dumps({**shape, "num_hidden_layers": str(shape["num_hidden_layers"])}))
    assert_one_line_error(launch("--model", str(tmp_path)), f"{config}: num_hidden_layers must be an integer")
    del shape["hidden_size"]
    config.write_text(json.dumps(shape))
    assert_one_line_error(launch("--model", str(tmp_path)), f"{config} has no 'hidden_size'")
    config.write_text("{'hidden_size': 64}")
    assert_one_line_error(launch("--model", str(tmp_path)), f"{config} is not valid JSON")


def test_a_tokenizer_that_does_not_load_is_named_in_one_line(demo_model_dir: Path, tmp_path: Path) -> None:
    """transformers' errors (a JSON error here) reached the user as a bare message, or as a
    traceback where they were not ValueErrors."""
    shutil.copytree(demo_model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer.json").write_text('{"x": ')
    assert_one_line_error(launch("--model", str(tmp_path), "--demo"), f"{tmp_path}: its tokenizer does not load")


def test_a_generation_config_the_http_api_cannot_use_is_named_in_one_line(demo_model_dir: Path, tmp_path: Path) -> None:
    """Its sampling values become the HTTP API's defaults (--generation-config auto): one a
    request could not ask for would have failed the front end's start."""
    shutil.copytree(demo_model_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -0.5}))
    result = launch("--model", str(tmp_path), "--http-port", str(free_port()))
    assert_one_line_error(result, f"{tmp_path / 'generation_config.json'}: Invalid value for temperature")


def test_devices_are_checked_before_a_presets_weights_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    result = launch("--model", "tiny-llama", "--devices", "99")
    assert_one_line_error(result, "99")
    assert not list(tmp_path.rglob("*.safetensors")), "weights written for a launch that could not run"


def test_max_model_len_defaults_to_the_models_own_limit(tiny_model_dirs: dict[str, Path]) -> None:
    model_dir = tiny_model_dirs["tiny-llama"]
    model = ModelConfig.from_pretrained(model_dir)
    assert ClusterConfig().engine_config(str(model_dir), model).max_model_len == model.max_position_embeddings
    shorter = ClusterConfig.from_settings({"max_model_len": 64}).engine_config(str(model_dir), model)
    assert shorter.max_model_len == 64


def test_the_demo_needs_a_tokenizer(tiny_model_dirs: dict[str, Path]) -> None:
    result = launch("--model", str(tiny_model_dirs["tiny-llama"]), "--demo")
    assert_one_line_error(result, "no tokenizer")


def test_the_demo_says_it_takes_the_http_api_down_with_it(tiny_model_dirs: dict[str, Path]) -> None:
    """An HTTP port opened by a demo closes once the demo has answered, seconds later."""
    result = launch("--model", str(tiny_model_dirs["tiny-llama"]), "--demo", "--http-port", str(free_port()))
    assert "drop --demo to keep serving" in result.stderr and result.returncode != 0, result.stderr


@pytest.mark.slow
def test_the_http_api_of_a_model_without_a_tokenizer_takes_token_ids(
    tiny_model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """As vLLM's --skip-tokenizer-init: a prompt of token ids is served, text gets a 400 naming
    the missing tokenizer, and the launcher says so at start."""
    import httpx

    from pdserve.bench.compare import LaunchedCluster

    http_port = free_port()
    args = ["--model", str(tiny_model_dirs["tiny-llama"]), "--http-port", str(http_port), "--max-model-len", "64"]
    with LaunchedCluster(args, tmp_path / "launch.log", start_timeout=300) as cluster:
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        ids = httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}, timeout=60)
        assert ids.status_code == 200 and ids.json()["usage"]["completion_tokens"] == 3, ids.text
        text = httpx.post(url, json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert text.status_code == 400 and "no tokenizer" in text.json()["error"]["message"], text.text
        assert "has no tokenizer: the HTTP API takes prompts of token ids only" in cluster.output()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--mode", "colocated", "--prefill-tp", "2"), "--prefill-tp applies to --mode disagg"),
        (("--colocated-tp", "2"), "--colocated-tp applies to --mode colocated"),
        (("--port", "70000"), "port"),
        (("--port", "6000", "--http-port", "6000"), "--http-port and --port must differ"),
        (("--log-stats-interval", "0.05"), "--log-stats-interval must be 0 (no line) or at least 1 s"),
        (("--served-model-name", "qwen"), "--served-model-name names the model of the HTTP API: give --http-port"),
        (("--served-model-name", "qwen,,gpt", "--http-port", "8000"), "--served-model-name holds an empty name"),
        (("--access-log",), "--access-log logs the HTTP API's requests: give --http-port too"),
        (("--generation-config", "none"), "--generation-config applies to the HTTP API: give --http-port too"),
        # A check names the flag the user typed, not the setting's key.
        (("--max-model-len", "-3"), "--max-model-len must be >= 2, got -3"),
        (("--prefill-tp", "0"), "--prefill-tp must be >= 1, got 0"),
        (("--decode-groups", "0"), "--decode-groups must be >= 1 (0 only where groups may join: with --master-addr)"),
        (("--transfer-layer-groups", "0"), "--transfer-layer-groups must be >= 1, got 0"),
        (("--host", "::1"), "--host must be an IPv4 address or name (0.0.0.0: every interface), got '::1'"),
        (("--transfer-staging-mib", "0"), "--transfer-staging-mib must be a positive finite number"),
        # ... and the flag that changes a default the check weighs it against.
        (("--max-num-batched-tokens", "8"), "--max-num-batched-tokens (8) must be >= --max-num-seqs (256)"),
        (("--transfer", "carrier-pigeon"), "carrier-pigeon"),
        (("--devices", "zero"), "comma-separated GPU ids"),
        (("--max-model-lenn", "5"), "--max-model-len"),
        (("--demo", "--demo-max-tokens", "0"), "--demo-max-tokens"),  # not after the cluster started
        # A preset's setting that the user never typed: where it is set.
        (("--config", "colocated", "--mode", "disagg"), "(colocated_groups: set in "),
        (("--config", "/tmp"), "--config /tmp: a directory, not a YAML file"),
        # Flags a mode of the command would drop without a word.
        (("--status", "tcp://127.0.0.1:1", "--prefill-tp", "2"), "takes only --auth-keys, not --prefill-tp"),
        (("--join", "127.0.0.1:1", "--role", "prefill", "--demo"), "--demo runs on the router node"),
        # vLLM habits: the error says what to type instead.
        (("serve", "demo"), "There is no 'serve' subcommand: pdserve --model MODEL"),
        (("--model", "demo", "--tensor-parallel-size", "2"), "--prefill-tp, --decode-tp, --colocated-tp"),
        (("--enable-prefix-caching",), "The prefix cache is on by default"),
    ],
)
def test_bad_flags_are_usage_errors(args: tuple[str, ...], needle: str) -> None:
    result = launch(*args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and needle in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("yaml", "needle"),
    [
        ("tensor_parallel_size: 2\n", "unknown setting 'tensor_parallel_size' (Each group has its own degree: "),
        ("demo: true\n", "unknown setting 'demo' (a launcher option, not a setting: give it on the command line)"),
        ("architectures: [LlamaForCausalLM]\n", "unknown setting 'architectures' (a model's shape, not a cluster"),
    ],
)
def test_a_presets_key_typed_by_habit_is_explained(tmp_path: Path, yaml: str, needle: str) -> None:
    """As the command line's habits are: vLLM's key, a launcher option, a model shape's file."""
    result = launch_preset(tmp_path, yaml)
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def launch_preset(tmp_path: Path, yaml: str) -> subprocess.CompletedProcess[str]:
    """``launch.py --config`` a preset file of ``yaml``."""
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml)
    return launch("--config", str(preset))


@pytest.mark.parametrize(
    ("yaml", "needle"),
    [
        ("prefill_tp: 0\n", "prefill_tp must be >= 1, got 0"),
        # A check written with flags names them as keys too, where the preset may set them.
        ("served_model_name: qwen\n", "served_model_name names the model of the HTTP API: give http_port too"),
    ],
)
def test_a_presets_bad_value_is_named_by_its_key(tmp_path: Path, yaml: str, needle: str) -> None:
    """A value from a YAML preset is named as the file spells it, not as a flag nobody typed."""
    result = launch_preset(tmp_path, yaml)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr and "--" not in result.stderr.split("Error: ")[-1], result.stderr


def test_both_commands_say_their_version() -> None:
    version = importlib.metadata.version("pdserve")
    for result, name in ((launch("--version"), "pdserve"), (client("--version"), "pdserve-client")):
        assert result.returncode == 0 and result.stdout == f"{name}, version {version}\n", result


def test_help_explains_every_flag() -> None:
    result = launch("--help")
    assert result.returncode == 0
    out = " ".join(result.stdout.split())  # help text wraps
    assert "Serve a disaggregated prefill/decode cluster" in out
    for section in ("Model options", "Topology options", "KV transfer options", "GPU options (used only on GPUs)"):
        assert section in out
    assert out.index("Engine options") < out.index("GPU options"), "GPU-only flags come last"
    for spec in cluster_settings():
        assert spec.flag in out, spec.flag
        assert spec.help.split()[0] in out
    assert out.count("[default: ") >= len(cluster_settings())


def test_the_http_front_ends_mistakes_are_one_line(busy_port: int, tmp_path: Path) -> None:
    """A wrong model, endpoint or busy port, and an unwritable cache, as launch.py says them: one
    line, before anything listens, not a traceback (or uvicorn's log after "startup complete")."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for args, env, needle in (
        (["--model", "nosuch"], {}, "model 'nosuch' is neither"),
        (["--endpoint", "foo"], {}, "endpoint 'foo': expected"),
        (["--port", str(busy_port)], {}, f"cannot listen on 127.0.0.1:{busy_port}"),
        ([], {"PDSERVE_CACHE": str(blocker / "cache")}, "(set PDSERVE_CACHE to a writable directory)"),
    ):
        command = [sys.executable, "-m", "pdserve.router.openai_server", "--model", "demo", *args]
        env = {**os.environ, **env}
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert_one_line_error(result, needle)


def test_the_http_front_ends_help_explains_every_option() -> None:
    from pdserve.router.openai_server import main

    result = subprocess.run(
        [sys.executable, "-m", "pdserve.router.openai_server", "-h"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    for option in main.params:
        assert option.help, f"--{option.name} has no help text"
        assert option.opts[0] in result.stdout


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--timeout", "-1"),
        ("--timeout", "0"),
        ("--timeout", "nan"),
        ("--drain-timeout", "-1"),
        ("--drain-timeout", "nan"),
    ],
)
def test_the_http_front_end_refuses_a_negative_wait(option: str, value: str) -> None:
    """Not a server whose every request fails with "the cluster ... stopped answering"."""
    result = subprocess.run(
        [sys.executable, "-m", "pdserve.router.openai_server", "--port", str(free_port()), option, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"Invalid value for '{option}'" in result.stderr, result.stderr


def test_status_prints_a_table_and_the_faults_in_words() -> None:
    """Each group's row: the router's own count of its requests (current), then its last report,
    said to be old when a long step (a long prefill) has kept its leader from reporting."""
    import threading

    import zmq

    from pdserve.cluster.protocol import GroupInfo, Stats, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    reports = {
        "prefill0": {"num_blocks": 100, "free_blocks": 100, "running": 0, "waiting": 0},
        "decode0": {"num_blocks": 100, "free_blocks": 75, "running": 2, "waiting": 1},
    }
    members = [
        GroupInfo("prefill", 0, 1, "ready", "ipc:///tmp/x/prefill0", ["cpu"], False, 2, 9000, 2, stats_age=93.4),
        GroupInfo("decode", 0, 1, "ready", "ipc:///tmp/x/decode0", ["cpu"], False, 3, 40, 5, stats_age=0.1),
    ]
    faults = {"group_failures": 1, "restarts": 1, "migrated": 2, "worker_failed": 0}

    def answer() -> None:
        identity, frame = router.recv_multipart()
        ask = decode(frame)
        assert ask.type == "stats_request"
        stats = Stats(3, reports, ready=True, faults=faults, members=members, tag=ask.tag)
        router.send_multipart([identity, encode(stats)])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        result = launch("--status", str(port), timeout=60)
    finally:
        thread.join(10)
        router.close()
    assert result.returncode == 0, result.stderr
    header, stale, row, summary, note = result.stdout.splitlines()
    assert re.split(r"\s{2,}", header) == [
        *("GROUP", "ROLE", "TP", "STATE", "DEVICES", "ADDRESS"),
        *("IN FLIGHT", "LOAD", "RUNNING", "WAITING", "KV USED"),
    ]
    assert row.split() == ["decode0", "decode", "1", "ready", "cpu", "ipc:///tmp/x/decode0", "3", "40", "2", "1"] + [
        "25/100",
        "(25%)",
    ]
    assert stale.split()[6:] == ["2", "9000", "0", "0", "0/100", "(0%)", "stats", "93", "s", "old"]
    assert summary == (
        "3 request(s) in flight; ready; faults: group_failures 1, restarts 1, migrated 2, worker_failed 0"
    )
    assert "between engine steps" in note


def test_client_endpoint_forms() -> None:
    assert normalize_endpoint("localhost:5555") == "tcp://localhost:5555"
    assert normalize_endpoint("6000") == "tcp://127.0.0.1:6000"
    assert normalize_endpoint("tcp://10.0.0.1:7") == "tcp://10.0.0.1:7"
    assert normalize_endpoint("tcp://[::1]:7") == "tcp://[::1]:7"
    for bad in (
        "localhost",
        "http://x:1",
        "host:99999",
        "tcp://127.0.0.1:abc",
        "tcp://:5555",
        "tcp://5555",
        "ipc://",
        "tcp://a b:1",
    ):
        with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
            normalize_endpoint(bad)  # "tcp://" forms were passed to ZMQ unchecked: a traceback (review)


def test_client_cli_errors_are_readable(busy_port: int) -> None:
    usage = client()
    assert usage.returncode == 2 and "Usage: python -m pdserve.cluster.client [OPTIONS] PROMPT" in usage.stderr
    bad = client("hi", "--endpoint", "localhost")
    assert bad.returncode == 2 and "expected tcp://HOST:PORT, HOST:PORT or PORT" in bad.stderr
    assert "Traceback" not in bad.stderr
    # Something listens there but is no cluster: the wait times out with one line saying what to do.
    silent = client("hi", "--endpoint", f"localhost:{busy_port}", "--timeout", "1")
    assert_one_line_error(silent, "no answer from a cluster", "launch.py")
    for timeout in ("-5", "0", "nan"):
        refused = client("hi", "--endpoint", f"localhost:{busy_port}", "--timeout", timeout)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert "must be a positive number of seconds (inf: no limit)" in refused.stderr, refused.stderr
    # Past what the wire's integers hold: a usage error, not an OverflowError's traceback (review).
    for option in ("--seed", "--max-tokens", "--top-k"):
        huge = client("hi", "--endpoint", f"localhost:{busy_port}", option, str(2**80))
        assert huge.returncode == 2 and "Traceback" not in huge.stderr, huge.stderr
        assert f"Invalid value for '{option}'" in huge.stderr, huge.stderr
    not_ids = client("1, two", "--token-ids", "--endpoint", f"localhost:{busy_port}")
    assert not_ids.returncode == 2 and "with --token-ids, PROMPT is integers" in not_ids.stderr, not_ids.stderr


def test_ctrl_c_on_the_client_aborts_its_request_and_exits_130() -> None:
    """It printed click's "Aborted!" and exited 1. A stand-in router takes the request and never
    answers, so Ctrl-C comes while the client waits for its first token."""
    import zmq

    from pdserve.cluster.protocol import decode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cluster.client", "hi", "--endpoint", str(port)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    try:
        seen: list[str] = []

        def next_message() -> Any:
            assert router.poll(60_000), f"no message from the client; saw {seen}"
            message = decode(router.recv_multipart()[-1])
            seen.append(message.type)
            return message

        while (sent := next_message()).type != "generate":
            pass
        process.send_signal(signal.SIGINT)
        while (aborted := next_message()).type != "abort":
            pass
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
        router.close()
    assert aborted.request_id == sent.request_id
    assert process.returncode == 130 and "Traceback" not in err and "Aborted" not in err, err


def test_a_client_without_the_clusters_keys_is_told_of_them(tmp_path: Path) -> None:
    """A router with --auth-keys drops a keyless client at its handshake: not "is it running?"
    about a cluster that runs, but the keys it wants."""
    import zmq

    from pdserve.cluster.auth import generate_keys, secure_server

    generate_keys(tmp_path)
    router = zmq.Context.instance().socket(zmq.ROUTER)
    authenticator = secure_server(router, tmp_path)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        keyless = client("hi", "--endpoint", str(port), "--timeout", "2")
    finally:
        router.close(linger=0)
        authenticator.stop()
    error = assert_one_line_error(keyless, "no answer from a cluster", "refused this client's handshake")
    assert "--auth-keys DIR" in error and "is it running?" not in error, error


def client_against_stand_in(
    reply: Callable[[Any], list[Any]], *args: str, stdin: bytes | None = None
) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    """``client(*args)`` against a stand-in router that answers its one ``generate`` with
    ``reply(generate)``: the client's result and the requests the router got."""
    import threading

    import zmq

    from pdserve.cluster.protocol import Generate, decode, encode

    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    received: list[Generate] = []

    def answer() -> None:
        identity, frame = router.recv_multipart()
        request = decode(frame)
        assert isinstance(request, Generate)
        received.append(request)
        for message in reply(request):
            router.send_multipart([identity, encode(message)])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        return client(*args, "--endpoint", str(port), stdin=stdin), received
    finally:
        thread.join(10)
        router.close()


def test_client_reads_the_prompt_from_stdin_for_a_dash() -> None:
    """``cat long.txt | pdserve-client -``: a prompt beyond what one command-line argument may
    hold (128 KiB on Linux) arrives whole, non-ASCII text included."""
    from pdserve.cluster.protocol import Final

    prompt = "Résumé ce texte, s'il te plaît. " * 8000 + "\n"

    def reply(request: Any) -> list[Any]:
        usage = {"prompt_tokens": 9, "completion_tokens": 1}
        return [Final(request.request_id or "", "stop", [7], "Fait.", usage, {})]

    result, received = client_against_stand_in(reply, "-", "--no-stream", stdin=prompt.encode())
    assert result.returncode == 0, result.stderr
    assert len(prompt.encode()) > 128 * 1024
    assert [r.prompt for r in received] == [prompt]
    assert result.stdout == "Fait.\n"
    not_text = client("-", "--endpoint", "1", stdin=b"caf\xe9")
    assert_one_line_error(not_text, "stdin is not UTF-8 text")


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_client_sends_and_prints_token_ids_for_a_model_without_a_tokenizer(stream: bool) -> None:
    """``--token-ids``: a random-weight preset has no tokenizer, so no text prompt and no text
    answer; the ids go as they are and the answer's ids are printed."""
    from pdserve.cluster.protocol import Chunk, Final

    def reply(request: Any) -> list[Any]:
        rid = request.request_id or ""
        chunks = [Chunk(rid, [token], "") for token in (7, 8)] if request.stream else []
        return [*chunks, Final(rid, "length", [7, 8], "", {"prompt_tokens": 3, "completion_tokens": 2}, {})]

    flag = "--stream" if stream else "--no-stream"
    result, received = client_against_stand_in(reply, "1, 2 3", "--token-ids", "--max-tokens", "2", flag)
    assert result.returncode == 0, result.stderr
    assert [(r.prompt, r.token_ids) for r in received] == [(None, [1, 2, 3])]
    assert result.stdout == "7 8\n"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--max-message-mib", "inf"), "--max-message-mib must be a finite number"),
        (("--client-heartbeat-timeout", "7000"), "--client-heartbeat-timeout must be at most 6553.5 s"),
    ],
)
def test_numbers_beyond_what_the_router_can_use_are_usage_errors(args: tuple[str, ...], needle: str) -> None:
    result = launch("--port", str(free_port()), *args)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and needle in result.stderr, result.stderr


def test_a_cpu_pool_too_small_for_one_sequence(tiny_model_dirs: dict[str, Path]) -> None:
    """As --num-blocks: the pool --cpu-kv-cache-bytes gives is checked before any rank starts."""
    result = launch(
        "--model",
        str(tiny_model_dirs["tiny-llama"]),
        "--port",
        str(free_port()),
        "--cpu-kv-cache-bytes",
        "1",
        "--max-model-len",
        "64",
    )
    assert_one_line_error(result, "--cpu-kv-cache-bytes", "fewer than --max-model-len 64")


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton kernels run on GPUs")
def test_triton_kernels_on_a_cpu_are_refused_before_any_rank_starts(tiny_model_dirs: dict[str, Path]) -> None:
    """Accepted, the cluster served and every request crashed its prefill group."""
    result = launch("--model", str(tiny_model_dirs["tiny-llama"]), "--port", str(free_port()), "--kernels", "triton")
    assert_one_line_error(result, "--kernels triton")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_stop_while_the_ranks_load_ends_them_and_the_launcher(demo_model_dir: Path, stop: int) -> None:
    """Ctrl-C (or a service manager's SIGTERM) while the model loads: the ranks end and so does
    the launcher, in one line, with exit 0 as a stop of a ready cluster (it used to exit 1 with
    an error, which a service manager records as a failed unit). Ctrl-C used to print "Aborted!"
    and then hang, the interpreter waiting at exit for ranks that ignore stop signals; SIGTERM
    ended the launcher silently."""
    ranks: list[int] = []

    def every_rank_loading(line: str) -> bool:
        if match := re.search(r"rank up: pid (\d+)", line):
            ranks.append(int(match[1]))
        return len(ranks) == 2

    result = launch_stopped(
        "--model", str(demo_model_dir), "--port", str(free_port()), at=every_rank_loading, stop=stop
    )
    assert_stopped_before_ready(result, "stopped before the cluster was ready: every process it started has ended")
    for pid in ranks:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid


def test_ctrl_c_during_the_demo_stops_it_cleanly(demo_model_dir: Path) -> None:
    """Ctrl-C mid-answer: that answer finishes (the drain), no further prompt is sent, and the
    run ends as any stop does. It used to send the next prompt into the shutting-down cluster
    and end with "Error: the demo failed: shutting_down", exit 1."""
    process = subprocess.Popen(
        [sys.executable, "launch.py", "--model", str(demo_model_dir), "--port", str(free_port())]
        + ["--prefill-tp", "1", "--decode-tp", "1", "--demo", "--demo-max-tokens", "32"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    assert process.stdout is not None
    try:
        for line in process.stdout:
            if line.startswith(">>> "):  # the first prompt is out
                process.send_signal(signal.SIGINT)
                break
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err[-3000:]
    assert "stopped: every process exited cleanly" in err and "demo failed" not in err, err[-3000:]
    assert out.count(">>> ") == 0, out  # the first prompt's line was read above; no other was sent


@pytest.mark.parametrize("visible_gpus", [0, 1])
def test_the_readmes_demo_runs_on_the_cpu_whatever_gpus_the_machine_has(
    demo_model_dir: Path, visible_gpus: int
) -> None:
    """The README's first command on a machine with one GPU (simulated in the launcher, whose
    ranks then see this machine's) said "3 ranks need 3 GPUs, 1 available" and exited 1."""
    fake = f"torch.cuda.device_count = lambda: {visible_gpus}; " if visible_gpus else ""
    run = f"import runpy, sys, torch; {fake}sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    args = ["--model", str(demo_model_dir), "--port", str(free_port()), "--prefill-tp", "2", "--decode-tp", "1"]
    result = subprocess.run(
        [sys.executable, "-c", run, "launch.py", *args, "--demo", "--demo-max-tokens", "4"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count(">>> ") == 3 and "every process exited cleanly" in result.stderr
    assert ("the demo runs on the CPU" in result.stderr) == (visible_gpus > 0), result.stderr[-3000:]


def test_ctrl_c_while_the_launcher_imports_is_quiet() -> None:
    """Ctrl-C in the first moments (torch still importing) printed a KeyboardInterrupt traceback."""
    process = subprocess.Popen(
        [sys.executable, "launch.py", "--port", str(free_port())],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    # Once Python catches SIGINT (else the signal kills it before any of its code runs, which
    # proves nothing), and a moment more: inside the imports, which take seconds.
    deadline = time.monotonic() + 30
    while not catches_sigint(process.pid):
        assert time.monotonic() < deadline and process.poll() is None, "Python never installed its SIGINT handler"
        time.sleep(0.01)
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and "Traceback" not in err, (process.returncode, err)


def catches_sigint(pid: int) -> bool:
    """Whether process ``pid`` has a SIGINT handler (its caught-signals mask in /proc)."""
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)$", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    return caught is not None and bool(int(caught.group(1), 16) & (1 << (signal.SIGINT - 1)))


def test_ctrl_c_while_the_demo_model_converts_says_nothing_had_started(tmp_path: Path) -> None:
    """Ctrl-C during the first use's conversion: one line, which does not claim processes ended."""
    result = launch_stopped(
        "--model",
        "demo",
        "--port",
        str(free_port()),
        at=lambda line: "converting the demo model" in line,
        env={**os.environ, "PDSERVE_CACHE": str(tmp_path)},  # nothing converted yet
    )
    assert_stopped_before_ready(result, "stopped before the cluster was ready (no process had started)")
