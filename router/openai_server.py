"""An OpenAI-compatible HTTP front end for a running cluster: the process that serves
``router.openai_app`` on uvicorn, its signals and its command line.

    python -m pdserve.router.openai_server --endpoint tcp://127.0.0.1:5555 --port 8000

``POST /v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events ending
``data: [DONE]``, or whole), ``GET /v1/models`` and ``/v1/models/{id}``, vLLM's ``POST /tokenize``
and ``/detokenize``, ``GET /health`` (200 while each role has a ready group and the cluster accepts
requests: one group of several restarting leaves it 200) and ``GET /metrics`` (Prometheus). With an
API key (``--api-key`` or ``PDSERVE_API_KEY``, as vLLM's), every ``/v1`` route and the two token
routes want it as ``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open. Browser
pages may call it from the origins ``--allowed-origins`` names (CORS; none by default). Requests go
to the router through one ``AsyncClient`` (ZMQ); a client that goes away mid-request has its
request aborted, which frees its KV on both sides. SIGTERM or SIGINT drains: new requests get 503
while the running ones finish (up to ``drain_timeout``: those still running then are aborted and
end with ``finish_reason`` "abort"), then the process exits 0; a second signal stops at once.

Several of them may serve one port (``--reuse-port``, what ``launch.py --api-servers N`` starts):
each binds it with ``SO_REUSEPORT``, and Linux spreads new connections among them; each has its
own connection to the router. With ``PROMETHEUS_MULTIPROC_DIR`` naming a directory they share,
``/metrics`` reports their counters summed (``router.metrics``).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
from collections.abc import Callable
from types import FrameType

import click
import uvicorn

from pdserve.cluster.auth import AUTH_CLIENT_HELP, DEFAULT_CLIENT, check_client_keys
from pdserve.cluster.client import DEFAULT_ENDPOINT, Seconds, normalize_endpoint
from pdserve.cluster.config import API_KEY_ENV, model_names
from pdserve.router.metrics import MULTIPROC_DIR_ENV
from pdserve.router.openai_app import SHARED, Frontend

logger = logging.getLogger(__name__)


class RepeatLimit(logging.Filter):
    """Lets a record of each of ``messages`` through once per ``interval`` seconds, the next one
    through saying how many it held back. A client that does not speak HTTP (a ZMQ client
    pointed at this port retries every 100 ms) would otherwise log a line a try."""

    def __init__(
        self, messages: tuple[str, ...], interval: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.messages = messages
        self.interval = interval
        self.clock = clock
        self._last: dict[str, tuple[float, int]] = {}  # message -> (when it was let through, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message not in self.messages:
            return True
        now = self.clock()
        last = self._last.get(message)
        if last is not None and now - last[0] < self.interval:
            self._last[message] = (last[0], last[1] + 1)
            return False
        held = 0 if last is None else last[1]
        self._last[message] = (now, 0)
        if held:
            record.msg, record.args = f"{message} ({held} more since the last such line)", ()
        return True


# uvicorn's line for each connection whose bytes are not HTTP
_NOT_HTTP = ("Invalid HTTP request received.",)


class _Server(uvicorn.Server):
    """uvicorn with a drain: the first SIGTERM/SIGINT refuses new requests (503) and exits once the
    running ones finish; a second exits at once. The signal is not re-raised after the exit (as
    uvicorn would), so a drained server exits 0. Once it listens it writes a byte to ``ready_fd``
    (if given) and closes it: a supervisor of several servers on one port cannot tell by
    connecting which of them listens."""

    def __init__(self, config: uvicorn.Config, frontend: Frontend, ready_fd: int | None = None) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.ready_fd = ready_fd

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_fd is not None:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)
            self.ready_fd = None
        elif self.started:  # on its own (the launcher prints the URL of those it starts)
            host, port = sockets[0].getsockname()[:2] if sockets else (self.config.host, self.config.port)
            logger.info(
                "the OpenAI API is on http://%s:%d/v1 (model %s), in front of the cluster at %s",
                f"[{host}]" if ":" in host else host,
                port,
                ", ".join(self.frontend.model_names),
                self.frontend.endpoint,
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.frontend.draining:
            self.should_exit = self.force_exit = True
        else:
            self.frontend.start_draining()

    async def on_tick(self, counter: int) -> bool:
        return await super().on_tick(counter) or self.frontend.drained()


def serve_openai(
    endpoint: str,
    model_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    drain_timeout: float = 30.0,
    timeout: float = 600.0,
    log_level: str = "info",
    auth_keys: str | None = None,
    auth_client: str = DEFAULT_CLIENT,
    max_message_mib: float = SHARED["max_message_mib"].default,
    max_prompt_chars: int | None = SHARED["max_prompt_chars"].default,
    api_key: str | None = None,
    allowed_origins: str | None = None,
    sock: socket.socket | None = None,
    ready_fd: int | None = None,
    send_timeout: float = SHARED["send_timeout"].default,
    parse_special_tokens: bool = SHARED["parse_special_tokens"].default,
    access_log: bool = SHARED["access_log"].default,
    generation_config: str = SHARED["generation_config"].default,
) -> None:
    """Serve the OpenAI API for the cluster at ``endpoint`` until SIGTERM/SIGINT (blocking; run it
    in its own process: the router's loop and this one should not share an interpreter lock). On
    ``sock`` if given (a bound socket: ``bound_socket``), else on ``host:port``; see
    ``_Server`` for ``ready_fd``."""
    frontend = Frontend(
        endpoint,
        model_dir,
        served_model_name,
        timeout=timeout,
        drain_timeout=drain_timeout,
        auth_keys=auth_keys,
        auth_client=auth_client,
        max_message_mib=max_message_mib,
        max_prompt_chars=max_prompt_chars,
        api_key=api_key,
        allowed_origins=allowed_origins,
        send_timeout=send_timeout,
        parse_special_tokens=parse_special_tokens,
        generation_config=generation_config,
    )
    config = uvicorn.Config(
        frontend.app(), host=host, port=port, log_level=log_level, access_log=access_log, timeout_graceful_shutdown=5
    )
    logging.getLogger("uvicorn.error").addFilter(RepeatLimit(_NOT_HTTP))  # after Config: it sets logging up
    if access_log:  # its lines are INFO, whatever the other logs' level (the launcher asks for warnings)
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    _Server(config, frontend, ready_fd).run(sockets=None if sock is None else [sock])


def bound_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to ``host:port``; OSError if it cannot (bound here, so that a busy port is
    one line before the tokenizer loads). With ``reuse_port``, ``SO_REUSEPORT``: other such
    sockets of this user may share it (Linux hands each new connection to one of them that
    listens). Not listening yet: uvicorn listens once the app has started, so that no connection
    waits on a server still loading its tokenizer while another could take it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


@click.command(context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@click.option("--endpoint", default=DEFAULT_ENDPOINT, help="The cluster's client endpoint.")
@click.option(
    "--model",
    default="demo",
    help="The served model: 'demo', a shape preset or a HF directory "
    "(the same as the cluster's; its tokenizer and chat template are used here).",
)
@click.option(
    "--served-model-name",
    default=None,
    help="The name clients give as 'model'; several, comma-separated, are aliases, the first named in responses "
    "[default: --model as given, as vLLM].",
)
@click.option("--host", default="127.0.0.1", help="Address the HTTP server binds.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, help="TCP port of the HTTP server.")
@click.option(
    "--drain-timeout",
    type=Seconds(zero=True),
    default=30.0,
    help="Seconds to finish running requests on SIGTERM; those still running then are aborted.",
)
@click.option(
    "--timeout",
    type=Seconds(),
    default=600.0,
    help="Seconds to wait for any one message of a request.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    help="Least severe log messages shown (the front end's and uvicorn's).",
)
@click.option("--auth-keys", default=None, help="The cluster's key directory, when it runs with --auth-keys.")
@click.option(
    "--auth-client",
    default=DEFAULT_CLIENT,
    help=AUTH_CLIENT_HELP,
)
@click.option(
    "--max-message-mib",
    type=click.FloatRange(min=0, min_open=True),
    default=SHARED["max_message_mib"].default,
    help="Largest request body, in MiB: a bigger one is answered 413 unread (launch.py's setting of that name).",
)
@click.option(
    "--max-prompt-chars",
    type=click.IntRange(min=1),
    default=SHARED["max_prompt_chars"].default,
    show_default=SHARED["max_prompt_chars"].default_text,
    help="Longest text prompt (a chat's messages together), in characters (launch.py's setting of that name).",
)
@click.option(
    "--api-key",
    envvar=API_KEY_ENV,
    show_envvar=True,
    default=SHARED["api_key"].default,
    help=SHARED["api_key"].help,
)
@click.option("--allowed-origins", default=SHARED["allowed_origins"].default, help=SHARED["allowed_origins"].help)
@click.option(
    "--send-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=SHARED["send_timeout"].default,
    help=SHARED["send_timeout"].help,
)
@click.option(
    "--parse-special-tokens/--no-parse-special-tokens",
    default=SHARED["parse_special_tokens"].default,
    help=SHARED["parse_special_tokens"].help,
)
@click.option(
    "--generation-config",
    type=click.Choice(SHARED["generation_config"].choices or ()),
    default=SHARED["generation_config"].default,
    show_default=True,
    help=SHARED["generation_config"].help,
)
@click.option(
    "--access-log/--no-access-log",
    default=SHARED["access_log"].default,
    help="Log each HTTP request (uvicorn's access log: client, method, path, status), as vLLM does by default.",
)
@click.option(
    "--reuse-port",
    is_flag=True,
    help="Bind the port with SO_REUSEPORT, so that several of these servers share it (Linux spreads the "
    f"connections among them); give them one {MULTIPROC_DIR_ENV} directory for /metrics to count them all.",
)
@click.option(
    "--ready-fd",
    type=click.IntRange(min=0),
    default=None,
    help="An inherited file descriptor to write one byte to, then close, once the server listens "
    "(for a supervisor such as launch.py).",
)
def main(
    endpoint: str,
    model: str,
    served_model_name: str | None,
    host: str,
    port: int,
    drain_timeout: float,
    timeout: float,
    log_level: str,
    auth_keys: str | None,
    auth_client: str,
    max_message_mib: float,
    max_prompt_chars: int | None,
    api_key: str | None,
    allowed_origins: str | None,
    send_timeout: float,
    parse_special_tokens: bool,
    generation_config: str,
    access_log: bool,
    reuse_port: bool,
    ready_fd: int | None,
) -> None:
    """An OpenAI-compatible HTTP server in front of a running cluster."""
    from pdserve.engine.presets import resolve_model_configs

    try:
        endpoint = normalize_endpoint(endpoint)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--endpoint") from None
    if api_key is not None and not api_key.strip():
        raise click.BadParameter("must not be empty", param_hint="--api-key")
    if auth_keys is not None:
        try:
            check_client_keys(auth_keys, auth_client)
        except FileNotFoundError as e:
            raise click.BadParameter(str(e), param_hint="--auth-keys") from None
    if served_model_name is not None:
        try:
            model_names(served_model_name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--served-model-name") from None
    shared = os.environ.get(MULTIPROC_DIR_ENV)
    if shared and not os.path.isdir(shared):
        raise click.UsageError(f"{MULTIPROC_DIR_ENV}={shared} is not a directory")
    # Labelled as the launcher's and the ranks' lines are ("launcher", "prefill0.0"), not by module
    # name, which reads "__main__" under ``python -m``.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s http %(levelname)s %(message)s")
    try:
        model_dir = str(resolve_model_configs(model))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    try:
        sock = bound_socket(host, port, reuse_port)
    except OSError as e:
        hint = " (another server there? choose another --port)" if e.errno == errno.EADDRINUSE else ""
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None
    if reuse_port:
        logger.info("process %d bound %s:%d with SO_REUSEPORT", os.getpid(), host, port)
        if not shared:
            logger.warning(
                "--reuse-port without %s: /metrics counts only the requests of the process a scrape reaches",
                MULTIPROC_DIR_ENV,
            )
    serve_openai(
        endpoint,
        model_dir,
        host,
        port,
        served_model_name or model,
        drain_timeout,
        timeout,
        log_level,
        auth_keys,
        auth_client,
        max_message_mib,
        max_prompt_chars,
        api_key,
        allowed_origins,
        sock,
        ready_fd,
        send_timeout,
        parse_special_tokens,
        access_log,
        generation_config,
    )


if __name__ == "__main__":
    main()
