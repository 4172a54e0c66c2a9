"""The OpenAI-compatible HTTP API as a FastAPI app: its routes, each request's run through the
cluster (one ``AsyncClient`` over ZMQ), its streamed events, draining and metrics.
``router.openai_server`` serves it (uvicorn, signals, the command line).

A client that goes away mid-request has its request aborted, which frees its KV on both sides.
While draining, new requests get 503 while the running ones finish (up to ``drain_timeout``:
those still running then are aborted and end with ``finish_reason`` "abort").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import importlib.metadata
import json
import logging
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.cluster.auth import DEFAULT_CLIENT
from pdserve.cluster.client import AsyncClient, ClusterError, ClusterUnavailable
from pdserve.cluster.config import cluster_settings, model_names, origins, prompt_chars_limit
from pdserve.cluster.protocol import Chunk, Error, Final, Logprobs, Sampling, Stats
from pdserve.engine.sampling import RequestError, validate_request
from pdserve.engine.tokenization import eos_token_ids, load_tokenizer
from pdserve.router.metrics import FrontendMetrics
from pdserve.router.openai_api import (
    APIError,
    GenerationRequest,
    LogprobsFormat,
    check_model,
    generation_defaults,
    parse_detokenize,
    parse_request,
    parse_tokenize,
)
from pdserve.router.rejection_log import RejectionLog, shorten
from pdserve.router.stop_strings import StopStringMatcher

T = TypeVar("T")
logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# launch.py's settings this server shares, under the same names, defaults and help.
SHARED = {
    s.key: s
    for s in cluster_settings()
    if s.key
    in (
        "max_message_mib",
        "max_prompt_chars",
        "api_key",
        "allowed_origins",
        "send_timeout",
        "parse_special_tokens",
        "generation_config",
        "access_log",
    )
}
STATS_TIMEOUT = 2.0  # seconds a health check or scrape waits for the router's stats
# Seconds a drain that ran out waits for the finals of the requests it then aborted.
DRAIN_ABORT_GRACE = 5.0
# Bodies up to this size are parsed on the event loop (docs/decisions.md: the worker thread's
# round trip costs more than tokenizing a prompt this short).
INLINE_BODY_BYTES = 1024


@dataclass
class Outcome:
    finish_reason: str
    usage: dict[str, int]
    cached_tokens: int | None = None  # prompt tokens the prefix cache served; None with it off
    stop_reason: str | int | None = None  # the stop string or stop_token_ids member that ended it


def _hf_config(model_dir: str) -> dict[str, Any]:
    """A Hugging Face model directory's config.json ({} where it has none, or not an object)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def model_vocab_size(model_dir: str) -> int | None:
    """The vocabulary size in a Hugging Face model directory's config.json (None if it says none)."""
    return _vocab_size(_hf_config(model_dir))


def _vocab_size(hf: dict[str, Any]) -> int | None:
    value = hf.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Frontend:
    """The HTTP front end's state: the cluster client, the tokenizer, metrics, and draining."""

    def __init__(
        self,
        endpoint: str,
        model_dir: str,
        served_model_name: str | None = None,
        timeout: float = 600.0,
        drain_timeout: float = 30.0,
        auth_keys: str | None = None,
        auth_client: str = DEFAULT_CLIENT,
        max_message_mib: float = SHARED["max_message_mib"].default,
        max_prompt_chars: int | None = SHARED["max_prompt_chars"].default,
        api_key: str | None = None,
        allowed_origins: str | None = None,
        send_timeout: float = SHARED["send_timeout"].default,
        parse_special_tokens: bool = SHARED["parse_special_tokens"].default,
        generation_config: str = SHARED["generation_config"].default,
    ) -> None:
        self.endpoint = endpoint
        self.parse_special_tokens = parse_special_tokens
        self.api_key = api_key.encode() if api_key else None
        self.allowed_origins = origins(allowed_origins) if allowed_origins else []
        self.max_body_bytes = int(max_message_mib * 2**20)
        self.max_message_mib = max_message_mib  # the router's too: a request past it as a message is refused
        self.max_prompt_chars = max_prompt_chars  # None: from the cluster's maximum model length
        self.auth_keys = auth_keys
        self.auth_client = auth_client
        self.model_dir = str(model_dir)
        # Aliases (vLLM's): a request may name any; responses name the first.
        self.model_names = model_names(served_model_name) if served_model_name else [Path(model_dir).name]
        self.timeout = timeout
        self.drain_timeout = drain_timeout
        self.tokenizer = load_tokenizer(self.model_dir)
        self.sampling_defaults = generation_defaults(self.model_dir) if generation_config == "auto" else {}
        if self.sampling_defaults:  # a request's output then differs from OpenAI's defaults: say so once
            logger.warning(
                "sampling fields a request leaves out take the model's generation_config.json values: %s "
                "(--generation-config none: OpenAI's defaults)",
                ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items()),
            )
        hf = _hf_config(self.model_dir)
        self.vocab_size = _vocab_size(hf)
        try:  # the engine's: an EOS that ends a request is no stop_reason
            self.eos_token_ids = eos_token_ids(hf)
        except (TypeError, ValueError):
            self.eos_token_ids = ()
        self._mismatch_logged = False
        self.metrics = FrontendMetrics(self.model_names[0])
        self.rejections = RejectionLog(logger)
        self.client: AsyncClient | None = None
        self.max_model_len: int | None = None
        self.running: set[str] = set()  # ids of the requests in flight
        self._told_special_text = False
        self.draining_since: float | None = None
        self._drain_aborted = False
        self.created = int(time.time())
        self._background: set[asyncio.Task[Any]] = set()
        self.stalls = _Stalls(send_timeout, self.rejections)
        # Bodies past INLINE_BODY_BYTES are checked and tokenized on one thread of their own: a
        # long prompt then holds up the next requests' parsing, not every stream's tokens. The
        # lock keeps the tokenizer to one caller at a time (it is not safe to call from several
        # threads at once), the loop's small bodies and the thread's large ones.
        self._parser = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="parse")
        self._tokenizing = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        self.client = AsyncClient(
            self.endpoint,
            timeout=self.timeout,
            auth_keys=self.auth_keys,
            auth_client=self.auth_client,
            max_message_mib=self.max_message_mib,
        )
        try:
            await self._model_len()
        except APIError as e:  # the cluster may come up after us: /health says when
            if e.code == "cluster_unavailable":  # (a model mismatch is logged where it is found)
                logger.warning("%s (yet): requests get %d %s until it does", e.message, e.status, e.code)
        stalls = asyncio.get_running_loop().create_task(self.stalls.watch())
        try:
            yield
        finally:
            stalls.cancel()
            self.client.close()
            self._parser.shutdown(wait=False, cancel_futures=True)

    @property
    def in_flight(self) -> int:
        return len(self.running)

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def start_draining(self) -> None:
        if self.draining_since is None:
            logger.info("draining: %d request(s) in flight", self.in_flight)
            self.draining_since = time.monotonic()

    def drained(self) -> bool:
        """Draining, and nothing left to wait for. Past ``drain_timeout`` the requests still
        running are aborted in the cluster (once), so that each still ends with its final and
        frees its KV, rather than being cut off by the exit; their finals get DRAIN_ABORT_GRACE."""
        if self.draining_since is None:
            return False
        if not self.running:
            return True
        waited = time.monotonic() - self.draining_since
        if waited <= self.drain_timeout:
            return False
        if not self._drain_aborted:
            self._drain_aborted = True
            logger.warning("drain timeout: aborting %d request(s) still running", len(self.running))
            assert self.client is not None
            for request_id in self.running:
                self._spawn(self.client.abort(request_id))
        return waited > self.drain_timeout + DRAIN_ABORT_GRACE

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` on its own: from a cancelled request an await of it would be cancelled too."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the app ----------------------------------------------------------------------------

    def app(self) -> ASGIApp:
        """The generation routes (``_GenerationRoutes``) in front of a FastAPI app for the rest."""
        app = FastAPI(title="pdserve", lifespan=self.lifespan, openapi_url=None, docs_url=None, redoc_url=None)

        @app.exception_handler(APIError)
        async def api_error(request: Request, error: APIError) -> JSONResponse:
            return self.error_response(request, error)

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, error: HTTPException) -> JSONResponse:
            return self.http_error_response(request, error.status_code, str(error.detail), error.headers)

        @app.exception_handler(ClientDisconnect)  # its own handler: Exception's re-raises after answering
        async def client_left(_: Request, error: ClientDisconnect) -> Response:
            return self.internal_error_response(error)

        @app.exception_handler(Exception)
        async def internal_error(_: Request, error: Exception) -> Response:
            return self.internal_error_response(error)

        v1 = APIRouter(prefix="/v1", dependencies=[Depends(self.authorize)] if self.api_key else [])

        @v1.get("/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [self._model_card(name) for name in self.model_names]})

        @v1.get("/models/{model:path}")  # a served name may hold a slash ("Qwen/Qwen2.5-1.5B")
        async def model(model: str) -> JSONResponse:
            if not model:  # "/v1/models/": the list, as FastAPI's redirect of a trailing slash would give
                return await models()
            check_model(model, self.model_names)
            return JSONResponse(self._model_card(model))

        app.include_router(v1)
        # vLLM's, beside /v1 as there; behind the API key like /v1 (they spend the server's CPU).
        tokens = APIRouter(dependencies=v1.dependencies)

        @tokens.post("/tokenize")
        async def tokenize(request: Request) -> JSONResponse:
            max_model_len = await self._model_len()
            body = await self._body(request)
            ids, token_strs = await self._tokenize(
                parse_tokenize,
                body,
                self.model_names,
                self.tokenizer,
                prompt_chars_limit(self.max_prompt_chars, max_model_len),
                self.parse_special_tokens,
            )
            return JSONResponse(
                {
                    "count": len(ids),
                    "max_model_len": max_model_len,
                    "tokens": ids,
                    "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if token_strs else None,
                }
            )

        @tokens.post("/detokenize")
        async def detokenize(request: Request) -> JSONResponse:
            ids = parse_detokenize(await self._body(request), self.model_names, self.tokenizer)
            return JSONResponse({"prompt": await self._tokenize(self.tokenizer.decode, ids)})

        app.include_router(tokens)

        @app.get("/version")  # vLLM's, open as /health is: which release answers
        async def version() -> JSONResponse:
            return JSONResponse({"version": importlib.metadata.version("pdserve")})

        @app.get("/health")
        async def health() -> JSONResponse:
            if self.draining:
                raise APIError(503, "the server is shutting down", "shutting_down")
            stats = await self._stats()
            if not stats.accepting:
                raise APIError(503, "the cluster is shutting down", "shutting_down")
            # Healthy while requests run now: one group of several restarting leaves the others
            # serving (pdserve:group_ready tells which is down).
            if stats.unserved_roles:
                raise APIError(503, _not_serving(stats), "not_ready")
            return JSONResponse({"status": "ok"})

        @app.get("/metrics")
        async def metrics() -> Response:
            with contextlib.suppress(APIError):  # an unreachable cluster: gauges left out, cluster_ready 0
                await self._stats()
            return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

        routes: ASGIApp = _GenerationRoutes(self, app)
        if self.allowed_origins:  # as vLLM's: any method and header (the openai client adds x-stainless-*)
            return CORSMiddleware(routes, allow_origins=self.allowed_origins, allow_methods=["*"], allow_headers=["*"])
        return routes

    def error_response(self, request: Request, error: APIError) -> JSONResponse:
        self.metrics.observe_error(error.code)
        self._log_rejection(request, error)
        return JSONResponse(error.body(), status_code=error.status)

    def http_error_response(
        self, request: Request, status: int, detail: str, headers: Mapping[str, str] | None = None
    ) -> JSONResponse:
        """A routing error (no such route, or not with this method) in OpenAI's shape and words."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
        where = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({where})", 405: f"Invalid method for URL ({where})"}
        error = APIError(status, message.get(status, detail), code)
        self._log_rejection(request, error)
        return JSONResponse(error.body(), status_code=status, headers=headers)

    def internal_error_response(self, error: Exception) -> Response:
        if isinstance(error, ClientDisconnect):  # left while sending its body: not this server's fault
            return Response(status_code=499)
        return JSONResponse(self._internal_error(error).body(), status_code=500)

    def _stream_error_events(self, error: Exception) -> bytes:
        """A stream's last events after ``error``: its status is sent already, so the error goes
        in the stream, as OpenAI does, counted once; a fault of this server's own is an internal one."""
        if isinstance(error, APIError):
            self.metrics.observe_error(error.code)
        else:
            error = self._internal_error(error)
        return _event(error.body()) + DONE

    def _internal_error(self, error: Exception) -> APIError:
        """A fault of this server's own (a bug), logged with its traceback and counted."""
        logger.exception("internal error")
        self.metrics.observe_error("internal_error")
        return APIError(500, f"internal error: {type(error).__name__}: {error}", "internal_error")

    def _model_card(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "root": self.model_dir,
            "max_model_len": self.max_model_len,
        }

    async def authorize(self, request: Request) -> None:
        """A /v1 request's API key, as OpenAI's clients send it (``Authorization: Bearer KEY``):
        401 in OpenAI's shape without it or with another. Async: a plain function would run on
        a worker thread, a hop for every request."""
        assert self.api_key is not None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401,
                "You didn't provide an API key: send it in an Authorization header using Bearer auth "
                "(Authorization: Bearer YOUR_KEY)",
                "invalid_api_key",
            )
        if not hmac.compare_digest(key.strip().encode("latin-1"), self.api_key):  # the header's own bytes
            raise APIError(401, "Incorrect API key provided", "invalid_api_key")

    def _log_rejection(self, request: Request, error: APIError) -> None:
        """A request refused for what the client sent (4xx): a line, rate-limited per code."""
        if error.status >= 500:
            return
        peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
        self.rejections.warning(
            error.code,
            "refused %s %s of client %s: %d %s: %s",
            request.method,
            shorten(request.url.path, 80),
            peer,
            error.status,
            error.code,
            shorten(error.message),
        )

    async def _stats(self) -> Stats:
        assert self.client is not None
        try:
            stats = await self.client.stats(timeout=STATS_TIMEOUT)
        except ClusterUnavailable:
            self.metrics.cluster.stats = None
            why = "refused this server's handshake: --auth-keys DIR, as the cluster's" if self.client.refused else ""
            raise APIError(
                503,
                f"the cluster at {self.endpoint} does not answer{f' ({why})' if why else ''}",
                "cluster_unavailable",
            ) from None
        self.metrics.cluster.stats = stats
        if stats.vocab_size and self.vocab_size and stats.vocab_size != self.vocab_size:
            # Another model's tokenizer would turn every prompt into ids the cluster refuses, or,
            # within its vocabulary, into garbage: serve nothing, and say why.
            why = (
                f"the cluster at {self.endpoint} serves a model of {stats.vocab_size} token ids, this "
                f"server's --model {self.model_dir} one of {self.vocab_size}: start it with the cluster's model"
            )
            if not self._mismatch_logged:
                logger.error(why)
                self._mismatch_logged = True
            raise APIError(503, why, "model_mismatch")
        if stats.max_model_len > 0:
            self.max_model_len = stats.max_model_len
        return stats

    async def _model_len(self) -> int:
        if self.max_model_len is None:
            await self._stats()
        if self.max_model_len is None:
            raise APIError(503, "the cluster did not say its maximum model length", "cluster_unavailable")
        return self.max_model_len

    # -- generation -------------------------------------------------------------------------

    async def generate(self, kind: Literal["completion", "chat"], request: Request) -> Response:
        arrival = time.perf_counter()
        if self.draining:
            raise APIError(503, "the server is shutting down", "shutting_down")
        max_model_len = await self._model_len()
        body = await self._body(request)
        gen = await self._parse(kind, body, max_model_len)
        if gen.special_text_as_text and not self._told_special_text:
            self._told_special_text = True  # a hint for the operator, once
            logger.warning(
                "a completion's prompt spells special tokens (such as a chat template's turns), read as plain "
                "text; --parse-special-tokens reads them as the tokens, as vLLM does"
            )
        if self.draining:  # began while the body came in: not yet in flight, so the drain won't wait for it
            raise APIError(503, "the server is shutting down", "shutting_down")
        if gen.choices > 1:
            return await self._generate_choices(gen, arrival, request)
        run = _Run(self, gen, arrival)
        texts = run.texts()
        return await self._respond(
            request,
            gen.stream,
            texts,
            lambda: self._whole(gen, run, texts),
            lambda first: self._events(gen, run, texts, first),
        )

    async def _generate_choices(self, gen: GenerationRequest, arrival: float, request: Request) -> Response:
        """``generate`` of a request for several choices (``n`` > 1, or a batch of prompts): one
        cluster request each, run side by side (the prefix cache shares a prompt's KV among
        those that start after the first)."""
        self._check_sampling(gen)
        runs = [_Run(self, gen, arrival, index) for index in range(gen.choices)]
        choices = _Choices(runs, per_piece_logprobs=gen.stream)

        async def whole() -> Response:
            texts: list[list[str]] = [[] for _ in runs]
            async for index, text, _ in choices:
                if text is not None:
                    texts[index].append(text)
            bodies = [
                gen.choice(
                    i, "".join(texts[i]), run.ended().finish_reason, run.take_logprobs(), run.ended().stop_reason
                )
                for i, run in enumerate(runs)
            ]
            return JSONResponse(gen.responses(bodies, *_total_usage(runs, gen.n)))

        return await self._respond(
            request, gen.stream, choices, whole, lambda first: self._choice_events(gen, runs, choices, first)
        )

    async def _respond(
        self,
        request: Request,
        stream: bool,
        pieces: AsyncIterator[Any],
        whole: Callable[[], Awaitable[Response]],
        events: Callable[[Any], AsyncIterator[bytes]],
    ) -> Response:
        """The response of a generation whose output comes as ``pieces``: ``whole()``, or a stream
        of ``events(first piece)`` once the first piece came, so that a request the cluster
        refuses still gets its 4xx/5xx status. From here a client that leaves ends the run (499);
        ``pieces`` is closed once nothing reads it, which aborts what still runs in the cluster."""
        client = _Disconnect(request.receive)
        streaming = False
        try:
            if not stream:
                return await whole()
            try:
                first = await anext(pieces)
            except StopAsyncIteration:
                first = None
            streaming = True
            return _EventStream(events(first), pieces, client, self.stalls)
        except asyncio.CancelledError:
            if not client.absorb():
                raise
            return Response(status_code=499)  # nobody is listening; 499 is nginx's "client closed request"
        finally:
            if not streaming:  # else the stream closes them when it ends
                client.stop()
                await pieces.aclose()  # type: ignore[attr-defined]

    def _check_sampling(self, gen: GenerationRequest) -> None:
        """The cluster's checks of a request, here: a request it would refuse is refused once, not
        once for each of its choices."""
        where = gen.prompt_param
        try:
            params = Sampling(**gen.sampling).to_params()
            if self.vocab_size is not None and self.max_model_len is not None:
                for i, prompt in enumerate(gen.prompts):
                    where = gen.prompt_param if len(gen.prompts) == 1 else f"{gen.prompt_param}.{i}"
                    validate_request(
                        prompt.token_ids, params, self.vocab_size, self.max_model_len, tokens_field="token_ids"
                    )
        except RequestError as e:  # answered as the router's refusal of one request is
            error = ClusterError(Error(None, "invalid_request", str(e)))
            raise _cluster_error(error, gen.prompt_param, where) from None

    async def _choice_events(
        self,
        gen: GenerationRequest,
        runs: list[_Run],
        choices: _Choices,
        first: tuple[int, str | None, dict[str, Any] | None] | None,
    ) -> AsyncIterator[bytes]:
        """``_events`` for several choices: each chunk names its choice; each choice ends with its
        own finish reason; the usage (if asked for) counts them all."""
        started = [False] * len(runs)

        def event(index: int, text: str | None, logprobs: dict[str, Any] | None) -> bytes:
            if text is None:
                last = None if gen.kind == "chat" else ""
                outcome = runs[index].ended()
                return _event(
                    gen.chunk(
                        last,
                        outcome.finish_reason,
                        first=not started[index],
                        logprobs=logprobs,
                        index=index,
                        stop_reason=outcome.stop_reason,
                        usage=outcome.usage if gen.continuous_usage else None,
                    )
                )
            usage = runs[index].usage_so_far() if gen.continuous_usage else None
            body = gen.chunk(text, first=not started[index], logprobs=logprobs, index=index, usage=usage)
            started[index] = True
            return _event(body)

        try:
            if first is not None:
                yield event(*first)
            async for piece in choices:
                yield event(*piece)
            tail = _event(gen.usage_chunk(*_total_usage(runs, gen.n))) if gen.include_usage else b""
        except Exception as error:  # the stream still ends with the error and [DONE], not cut off
            yield self._stream_error_events(error)
            return
        yield tail + DONE

    async def _parse(self, kind: Literal["completion", "chat"], body: bytes, max_model_len: int) -> GenerationRequest:
        """``parse_request`` of a body: a small one here, as handing it to the parsing thread and
        back costs more than its parse; a larger one, or any while the thread tokenizes, there."""
        args = (
            kind,
            body,
            self.model_names,
            self.tokenizer,
            max_model_len,
            prompt_chars_limit(self.max_prompt_chars, max_model_len),
            self.parse_special_tokens,
            self.sampling_defaults,
            not self._told_special_text,
        )
        if len(body) <= INLINE_BODY_BYTES and self._tokenizing.acquire(blocking=False):
            try:
                return parse_request(*args)
            finally:
                self._tokenizing.release()
        return await self._tokenize(parse_request, *args)

    async def _tokenize(self, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` on the parsing thread, which tokenizes one request at a time."""
        return await asyncio.get_running_loop().run_in_executor(self._parser, self._locked, work, *args)

    def _locked(self, work: Callable[..., T], *args: Any) -> T:
        with self._tokenizing:
            return work(*args)

    async def _body(self, request: Request) -> bytes:
        """The request's body, refused (413) past ``max_body_bytes`` before more of it is read:
        by its Content-Length when it gives one, else as it streams in."""
        too_large = APIError(
            413,
            f"The request body is larger than this server accepts ({self.max_body_bytes} bytes)",
            "request_too_large",
        )
        with contextlib.suppress(ValueError):  # a malformed length: the stream's count decides
            if int(request.headers.get("content-length", "0")) > self.max_body_bytes:
                raise too_large
        parts: list[bytes] = []
        size = 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                raise too_large
            parts.append(part)
        return b"".join(parts)

    async def _whole(self, gen: GenerationRequest, run: _Run, texts: AsyncIterator[str]) -> JSONResponse:
        parts = [text async for text in texts]
        outcome = run.ended()
        return JSONResponse(
            gen.response(
                "".join(parts),
                outcome.finish_reason,
                outcome.usage,
                outcome.cached_tokens,
                run.take_logprobs(),
                outcome.stop_reason,
            )
        )

    async def _events(
        self, gen: GenerationRequest, run: _Run, texts: AsyncIterator[str], first: str | None
    ) -> AsyncIterator[bytes]:
        """The stream's events; the last item holds every event after the text (the final chunk,
        usage, ``[DONE]``), so that they leave in one write."""
        sent = False  # chat: the first chunk carries the assistant's role
        delta = _DeltaEvents(gen)
        usage = run.usage_so_far if gen.continuous_usage else lambda: None
        try:
            if first is not None:
                yield _event(gen.chunk(first, first=True, logprobs=run.take_logprobs(), usage=usage()))
                sent = True
            async for text in texts:
                if run.logprobs_format is not None or gen.continuous_usage:
                    yield _event(gen.chunk(text, first=not sent, logprobs=run.take_logprobs(), usage=usage()))
                else:
                    yield delta(text) if sent else _event(gen.chunk(text, first=True))
                sent = True
            outcome = run.ended()
            tail = _event(
                gen.chunk(
                    None if gen.kind == "chat" else "",
                    outcome.finish_reason,
                    first=not sent,
                    logprobs=run.pending_logprobs(),
                    stop_reason=outcome.stop_reason,
                    usage=outcome.usage if gen.continuous_usage else None,
                )
            )
            if gen.include_usage:
                tail += _event(gen.usage_chunk(outcome.usage, outcome.cached_tokens))
        except Exception as error:  # the stream still ends with the error and [DONE], not cut off
            yield self._stream_error_events(error)
            return
        yield tail + DONE


class _Run:
    """One request's run through the cluster: ``texts()`` yields each chunk's text (after the stop
    strings), then ``outcome`` holds the finish reason and usage. Left early (the client went
    away, a timeout), it aborts the request in the cluster."""

    def __init__(self, frontend: Frontend, gen: GenerationRequest, arrival: float, index: int = 0) -> None:
        self.frontend = frontend
        self.gen = gen
        self.arrival = arrival
        # The id its client sees is the one in the cluster's logs (with the choice's index, of several).
        self.request_id = gen.id if gen.choices == 1 else f"{gen.id}-{index}"
        self.prompt = gen.prompt_of(index)
        self.sampling = gen.sampling_of(index)
        self.outcome: Outcome | None = None
        # Where the request asked for log-probabilities: those of the pieces yielded and not yet taken.
        self.logprobs_format = (
            None
            if gen.sampling.get("logprobs") is None
            else LogprobsFormat(gen.kind, frontend.tokenizer, gen.skip_special_tokens, gen.tokens_as_ids)
        )
        self._pieces: list[tuple[list[int], Logprobs]] = []
        # An echoing request's: its prompt's log-probabilities, until they go with the first piece.
        self._prompt_logprobs: Logprobs | None = None
        self.generated = 0  # tokens in the chunks so far

    def usage_so_far(self) -> dict[str, int]:
        """The usage of the tokens come so far (vLLM's ``continuous_usage_stats``)."""
        return {"prompt_tokens": len(self.prompt.token_ids), "completion_tokens": self.generated}

    def ended(self) -> Outcome:
        """How the run ended (once ``texts`` is exhausted)."""
        assert self.outcome is not None, "the run has not ended"
        return self.outcome

    def take_logprobs(self) -> dict[str, Any] | None:
        """The ``logprobs`` body of the tokens behind the text yielded since the last call (None
        if the request asked for none)."""
        if self.logprobs_format is None:
            return None
        token_ids: list[int] = []
        logprobs = Logprobs([], [], [])
        for ids, piece in self._pieces:
            token_ids += ids
            logprobs.extend(piece)
        self._pieces.clear()
        if self._prompt_logprobs is None:
            return self.logprobs_format(token_ids, logprobs)
        prompt = self.logprobs_format.prompt(self.prompt.token_ids, self._prompt_logprobs)
        self._prompt_logprobs = None
        return LogprobsFormat.join(prompt, self.logprobs_format(token_ids, logprobs))

    def pending_logprobs(self) -> dict[str, Any] | None:
        """``take_logprobs`` of the tokens no text went out with (None if there are none): what the
        finish chunk of a stream carries."""
        return self.take_logprobs() if self._pieces or self._prompt_logprobs is not None else None

    def texts(self) -> AsyncIterator[str]:
        """The output's text as it comes, never empty (an echoing request's first piece after its prompt)."""
        return self._texts() if self.prompt.echo is None else self._echoed(self._texts())

    async def _echoed(self, texts: AsyncIterator[str]) -> AsyncIterator[str]:
        async with contextlib.aclosing(texts):  # type: ignore[type-var]
            prefix = self.prompt.echo or ""
            async for text in texts:
                yield prefix + text
                prefix = ""
            if prefix:  # nothing came after it (the request ended before its first token)
                yield prefix

    async def _texts(self) -> AsyncIterator[str]:
        frontend, metrics, gen = self.frontend, self.frontend.metrics, self.gen
        client = frontend.client
        assert client is not None
        matcher = StopStringMatcher(gen.stop, gen.include_stop) if gen.stop and not gen.echo_only else None
        min_tokens = self.sampling.get("min_tokens", 0)  # no stop string ends the output before these
        ended = False  # the cluster sent the request's terminal message
        failed = False  # answered with an error: counted as that alone
        last: float | None = None
        # A request_id of the client's that is running already is the cluster's to refuse
        # (duplicate_request_id): the running one stays counted.
        counted = self.request_id not in frontend.running
        frontend.running.add(self.request_id)
        try:
            stream = client.stream(
                token_ids=self.prompt.token_ids,
                request_id=self.request_id,
                skip_special_tokens=gen.skip_special_tokens,
                include_stop_str_in_output=gen.include_stop,
                **self.sampling,
            )
            async with contextlib.aclosing(stream) as messages:
                async for message in messages:
                    now = time.perf_counter()
                    echoed = self.prompt.echo is not None and isinstance(message, Chunk)
                    if echoed and message.prompt_logprobs is not None:  # the first chunk's; the final repeats them
                        self._prompt_logprobs = message.prompt_logprobs
                    if isinstance(message, Final):
                        ended = True
                        if gen.echo_only:  # the token run for the prompt's log-probabilities is no output
                            self._finish("length", message, now, completion_tokens=0)
                        else:
                            self._finish(message.finish_reason, message, now)
                        # Counted first: a client that leaves while the tail goes out ends this here.
                        if matcher is not None and (tail := matcher.flush()):
                            yield tail
                        return
                    assert isinstance(message, Chunk)
                    if last is None:
                        metrics.ttft.observe(now - self.arrival)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                    if gen.echo_only:
                        continue
                    self.generated += len(message.token_ids)
                    if self.logprobs_format is not None and message.logprobs is not None:
                        self._pieces.append((message.token_ids, message.logprobs))
                    # A chunk without text (a stop token's, one held back) sends nothing: its tokens'
                    # log-probabilities go with the next text, or the finish.
                    if matcher is None:
                        if message.text:
                            yield message.text
                        continue
                    text, stopped = matcher.add(message.text, may_stop=self.generated > min_tokens)
                    if stopped:  # the cluster only knows stop tokens: end it here, before the client reads on
                        await client.abort(self.request_id)
                    if text:
                        yield text
                    if stopped:  # then read its final
                        final = None
                        async for message in messages:
                            final = message if isinstance(message, Final) else final
                        ended = True
                        assert final is not None
                        # What the abort's final counts may include tokens generated after the stop
                        # string, before the abort reached the cluster: the completion ends with it.
                        self._finish("stop", final, now, self.generated, matcher.matched)
                        return
        except ClusterError as e:
            ended = True
            raise _cluster_error(e, gen.prompt_param, request_id=gen.request_id) from None
        except ClusterUnavailable:
            failed = True
            raise APIError(
                503, f"the cluster at {frontend.endpoint} stopped answering", "cluster_unavailable"
            ) from None
        finally:
            if counted:
                frontend.running.discard(self.request_id)
            if not ended:
                frontend._spawn(self._abandoned(time.perf_counter(), counted=failed))

    def _stop_token(self, final: Final) -> int | None:
        """The request's ``stop_token_ids`` member that ended it, as the engine decides: the
        model's EOS first (no stop reason, as in vLLM), unless ``ignore_eos``."""
        if final.finish_reason != "stop" or not final.token_ids:
            return None
        token = final.token_ids[-1]
        if token not in self.sampling.get("stop_token_ids", ()):
            return None
        return None if token in self.frontend.eos_token_ids and not self.sampling.get("ignore_eos") else token

    async def _abandoned(self, left: float, counted: bool) -> None:
        """Its client left (or the cluster stopped answering) before the end: abort the request,
        freeing its KV in the cluster, and count it in every metric with what it used, as a
        finished one is, unless it was ``counted`` already (as the error its client got)."""
        metrics = self.frontend.metrics
        assert self.frontend.client is not None
        final = await self.frontend.client.cancel(self.request_id)
        if counted:
            return
        metrics.e2e.observe(left - self.arrival)
        if final is None:  # what it used as far as this front end saw
            metrics.observe_final("abort", self.usage_so_far(), {})
        else:
            metrics.observe_final("abort", final.usage, final.timings)

    def _finish(
        self,
        reason: str,
        final: Final,
        now: float,
        completion_tokens: int | None = None,
        stop_string: str | None = None,
    ) -> None:
        usage = final.usage
        if completion_tokens is not None:
            usage = {**usage, "completion_tokens": completion_tokens}
        cached = final.timings.get("cached_tokens")
        stop_reason = stop_string if stop_string is not None else self._stop_token(final)
        self.outcome = Outcome(reason, usage, None if cached is None else int(cached), stop_reason)
        self.frontend.metrics.e2e.observe(now - self.arrival)
        self.frontend.metrics.observe_final(reason, usage, final.timings)


def _cluster_error(
    error: ClusterError, prompt_param: str = "prompt", where: str | None = None, request_id: str | None = None
) -> APIError:
    """The cluster's error reply as an HTTP error (docs/protocol.md lists the codes); a fault
    the cluster finds in the prompt's ids is the request's ``prompt_param`` (a chat's messages),
    named as ``where`` (a batch's prompt.i) in the message; a duplicate, as the client's
    ``request_id`` (the cluster knows it prefixed: ``cmpl-<request_id>``)."""
    if error.code == "invalid_request":
        field, _, why = error.error.message.partition(": ")
        if field == "token_ids":  # the ids this server made of the request's prompt
            return APIError(400, f"{where or prompt_param}: {why}", "invalid_request", prompt_param)
        return APIError(400, error.error.message, "invalid_request", field)
    if error.code == "request_too_large":  # larger as the cluster's message than as JSON
        return APIError(413, error.error.message, error.code)
    if error.code == "duplicate_request_id":  # a request_id the client gave, still running
        message = error.error.message if request_id is None else f"request_id {request_id!r} is already running"
        return APIError(400, message, error.code, "request_id")
    # The ones a later try may not meet (503, as OpenAI's "engine is currently overloaded").
    if error.code in ("shutting_down", "shutdown", "worker_failed", "no_group", "overloaded"):
        return APIError(503, error.error.message, error.code)
    return APIError(500, f"{error.code}: {error.error.message}", error.code)


def _not_serving(stats: Stats) -> str:
    """Why requests cannot run now: the roles with no ready group, and every group's state."""
    states = ", ".join(f"{m.role}{m.group} {m.state}" for m in stats.members) or "none"
    return f"the cluster cannot serve now: no ready {' or '.join(stats.unserved_roles)} group (groups: {states})"


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class _Choices:
    """The pieces of a request's choices as they come, from all of its runs at once:
    ``(index, text, logprobs)``, then ``(index, None, logprobs)`` once choice ``index`` has
    ended (those of its tokens no text went out with).
    The first error a choice meets is raised, and ``aclose`` ends every run (aborting those
    still in the cluster). ``per_piece_logprobs``: each piece takes its tokens' logprobs body
    (a stream's chunks); otherwise they stay with the run for its whole response."""

    def __init__(self, runs: list[_Run], per_piece_logprobs: bool) -> None:
        self.per_piece_logprobs = per_piece_logprobs
        self.queue: asyncio.Queue[tuple[int, str | None, dict[str, Any] | None] | BaseException] = asyncio.Queue()
        self.open = len(runs)
        self.tasks = [asyncio.create_task(self._pump(index, run)) for index, run in enumerate(runs)]

    async def _pump(self, index: int, run: _Run) -> None:
        try:
            async with contextlib.aclosing(run.texts()) as texts:
                async for text in texts:
                    logprobs = run.take_logprobs() if self.per_piece_logprobs else None
                    self.queue.put_nowait((index, text, logprobs))
            self.queue.put_nowait((index, None, run.pending_logprobs() if self.per_piece_logprobs else None))
        except Exception as e:  # noqa: BLE001 (the consumer raises it: an APIError, or a bug to see)
            self.queue.put_nowait(e)

    def __aiter__(self) -> _Choices:
        return self

    async def __anext__(self) -> tuple[int, str | None, dict[str, Any] | None]:
        if self.open == 0:
            raise StopAsyncIteration
        piece = await self.queue.get()
        if isinstance(piece, BaseException):
            raise piece
        if piece[1] is None:
            self.open -= 1
        return piece

    async def aclose(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _total_usage(runs: list[_Run], n: int) -> tuple[dict[str, int], int | None]:
    """Several choices' usage and cached prompt tokens: each prompt once (from its first of
    ``n`` choices), every choice's generated tokens."""
    firsts = [run.ended() for run in runs[::n]]
    usage = {
        "prompt_tokens": sum(outcome.usage.get("prompt_tokens", 0) for outcome in firsts),
        "completion_tokens": sum(run.ended().usage.get("completion_tokens", 0) for run in runs),
    }
    cached = [outcome.cached_tokens for outcome in firsts if outcome.cached_tokens is not None]
    return usage, sum(cached) if cached else None


class _DeltaEvents:
    """The events of a stream's text chunks after the first: the request's chunk rendered once
    around a marker, so that each chunk costs one ``json.dumps`` of its text, not of its body."""

    def __init__(self, gen: GenerationRequest) -> None:
        mark = uuid.uuid4().hex
        self.head, found, self.tail = _event(gen.chunk(mark)).partition(json.dumps(mark).encode())
        assert found, "a chunk's text is one JSON string of its body"

    def __call__(self, text: str) -> bytes:
        return self.head + json.dumps(text, ensure_ascii=False).encode() + self.tail


class _GenerationRoutes:
    """``POST /v1/completions`` and ``/v1/chat/completions`` served straight from uvicorn, every
    other request passed to ``app``: the hot routes skip FastAPI's request handling and middleware,
    and the wrappers several of them put around each event's ``send`` (docs/decisions.md). Errors
    are answered as ``app``'s handlers answer them."""

    PATHS: dict[str, Literal["completion", "chat"]] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}

    def __init__(self, frontend: Frontend, app: ASGIApp) -> None:
        self.frontend = frontend
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # With a trailing slash too, which FastAPI's routes would redirect here.
        kind = self.PATHS.get(scope["path"].rstrip("/")) if scope["type"] == "http" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        frontend = self.frontend
        request = Request(scope, receive, send)
        response: Response
        try:
            if scope["method"] != "POST":
                response = frontend.http_error_response(request, 405, "Method Not Allowed", {"Allow": "POST"})
            else:
                if frontend.api_key is not None:
                    await frontend.authorize(request)
                response = await frontend.generate(kind, request)
        except APIError as error:
            response = frontend.error_response(request, error)
        except Exception as error:
            response = frontend.internal_error_response(error)
        await response(scope, receive, send)


class _Disconnect:
    """Watches a request's client from when its body is read: if it disconnects before ``stop``,
    the task that made this is cancelled (a stream's run then aborts the request in the cluster).
    One watcher task for the whole request, waiting for its first token included; ``absorb``
    tells that cancellation from any other."""

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.gone = False
        self.stopped = False
        self.watcher = asyncio.get_running_loop().create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.leave()

    def stop(self) -> None:
        self.stopped = True
        self.watcher.cancel()

    def leave(self) -> None:
        """Treat the client as gone (see ``_Stalls``)."""
        if not self.stopped:
            self.gone = True
            self.task.cancel()

    def absorb(self) -> bool:
        """Called on a CancelledError: True, and the cancellation undone so that later awaits of
        the task run, when the client leaving caused it."""
        if not self.gone:
            return False
        if sys.version_info >= (3, 11):
            self.task.uncancel()
        return True


class _Stalls:
    """Streams whose client takes nothing for ``timeout`` seconds: a send waits while the buffers
    for a connection are full, and would hold its request (its replies piling up in memory, the
    front end's drain waiting on it) for as long as the client neither reads nor leaves. Such a
    client is taken for gone: its request is aborted and uvicorn closes the connection."""

    def __init__(self, timeout: float, rejections: RejectionLog) -> None:
        self.timeout = timeout
        self.rejections = rejections  # a line per stalled client, rate-limited: many may stall at once
        self.sending: dict[_Disconnect, float] = {}  # a stream's client -> when its pending send began

    async def watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.timeout / 4))
            now = loop.time()
            for client, since in list(self.sending.items()):
                if now - since > self.timeout:
                    self.rejections.warning(
                        "send_timeout",
                        "a client read nothing of its stream for %gs: its request is aborted",
                        self.timeout,
                    )
                    client.leave()


class _EventStream(Response):
    """A server-sent event stream that closes its request's run however the response ends: a
    client that disconnects cancels it (possibly before it started), as Starlette's
    ``StreamingResponse`` does, but through the request's one watcher rather than an anyio task
    group; and the last event goes out with the end of the body, in one write."""

    media_type = "text/event-stream"

    def __init__(
        self, events: AsyncIterator[bytes], texts: AsyncIterator[str], client: _Disconnect, stalls: _Stalls
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache"})
        self.events = events
        self.texts = texts
        self.client = client
        self.stalls = stalls

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client, sending = self.client, self.stalls.sending
        clock = asyncio.get_running_loop().time
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            more = True
            async for event in self.events:
                more = not event.endswith(DONE)
                sending[client] = clock()
                await send({"type": "http.response.body", "body": event, "more_body": more})
                del sending[client]
            if more:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not client.absorb():
                raise
        finally:
            sending.pop(client, None)
            client.stop()
            await self.texts.aclose()  # type: ignore[attr-defined]
