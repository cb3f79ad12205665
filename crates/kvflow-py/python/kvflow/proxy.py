"""kvflow's proxy in front of vLLM's prefill (P) and decode (D) OpenAI servers.

Clients talk to the proxy as to one vLLM server; it splits each ``/v1/completions`` and
``/v1/chat/completions`` request into a prefill leg for a P (an engine with ``kv_role``
``kv_producer``) and a decode leg for a D (``kv_consumer``), and streams D's answer back.
It speaks the two ``kv_transfer_params`` protocols of vLLM's disaggregated proxies, so a
deployment that works with vLLM's NixlConnector or NixlPushConnector works with kvflow's
connectors through it, and the other way round.

``--mode pull`` (NixlConnector's protocol): P prefills the prompt (``max_tokens`` 1, not
streamed) under ``do_remote_decode``; its answer's ``kv_transfer_params`` go to D unchanged
(kvflow's ``"kvflow"`` key included), and D reads the KV cache from P.

``--mode push`` (NixlPushConnector's protocol): P and D get their legs at the same time, both
carrying one fresh ``transfer_id``; D learns P's engine id and side channel from the command
line, not from P's answer, and P writes the KV cache into D's blocks.

Usage::

    python -m kvflow.proxy --mode pull --prefill http://p0:8100 --decode http://d0:8200
    python -m kvflow.proxy --mode push \\
        --prefill http://p0:8100@prefill-0@10.0.0.1:5600@2 --decode http://d0:8200

``--prefill`` and ``--decode`` repeat; each kind is served round robin.
A P is ``URL`` or, for push mode, ``URL@ENGINE_ID@SIDEHOST:SIDEPORT[@TP]``: ENGINE_ID is P's
``kv_transfer_config.engine_id``, SIDEHOST:SIDEPORT its NIXL side channel (the host P
advertises and its ``VLLM_NIXL_SIDE_CHANNEL_PORT``), TP its tensor-parallel size (default 1).
URLs are a server's root (``http://host:port`` or ``host:port``, without ``/v1``) and hold no
``@``; in pull mode a P's coordinates are accepted and unused, so one command line serves both.

Behaviour worth knowing:

- ``--nixl-fields-only`` (pull): D gets only NixlConnector's fields of P's answer, without
  kvflow's ``"kvflow"`` key, as a router that rebuilds them sends it; kvflow's D takes either.
- Request ids: both legs get the same ``X-Request-Id`` (the client's, else a fresh uuid), so
  P and D log one id and push mode's ``remote_request_id`` names P's request.
  ``--no-request-id`` sends none; push mode's ``remote_request_id`` is then null and only
  ``transfer_id`` pairs the legs. A client's ``Authorization`` header goes to both legs.
- A failing P: in pull mode, a P that answers an error, times out or cannot be reached fails
  the request (D is not asked); a P answering 4xx passes that status on (D would refuse the
  request too), any other failure gives 502, a timeout 504, and the error body names P's URL.
  A P that answers but gives no ``kv_transfer_params`` (not set up as a producer) is logged
  at WARNING and D computes the prompt itself, since the answer is still right.
  In push mode a P failure is logged at WARNING; if D has not answered yet, its leg is
  dropped (D would otherwise wait for KV that never comes) and the client gets P's error.
- ``n`` > 1 and ``best_of``: P prefills once (its leg drops ``n`` and ``best_of``); D gets the
  request as sent, and its samples share the prompt's KV cache.
- Chat: P's leg sets ``max_completion_tokens`` as well as ``max_tokens`` to 1; otherwise both
  routes are handled alike. ``min_tokens`` and ``min_completion_tokens`` are dropped from P's
  leg, which would refuse them beside ``max_tokens`` 1.
- Limits: a request body over 16 MiB gets 413. ``--timeout`` bounds each wait for an
  upstream's next bytes (connecting, headers, each chunk); one that passes gives 504 before
  the answer started, and ends the answer after. A client that goes away closes the upstream
  connections of its request, which makes vLLM abort it.

Other routes: ``GET /health`` answers 200, ``GET /v1/models`` is relayed to a D, the rest 404.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

log = logging.getLogger("kvflow.proxy")

MAX_BODY_BYTES = 16 * 1024 * 1024
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# NixlConnector's fields of P's answer, which routers rebuild.
NIXL_FIELDS = (
    "do_remote_prefill", "do_remote_decode", "remote_engine_id", "remote_block_ids", "remote_host",
    "remote_port", "remote_request_id", "tp_size",
)
# P would refuse these beside max_tokens 1, and it prefills once whatever D samples.
PREFILL_DROPS = ("stream_options", "min_tokens", "min_completion_tokens", "n", "best_of")


@dataclass(frozen=True)
class Prefill:
    """A prefill engine: its OpenAI server and, for push mode, where D finds its side channel."""

    url: str
    engine_id: str | None = None
    side_host: str | None = None
    side_port: int | None = None
    tp_size: int = 1


@dataclass(frozen=True)
class ProxyConfig:
    """What the proxy serves: the mode, the engines, and its bounds."""

    mode: str
    prefills: tuple[Prefill, ...]
    decodes: tuple[str, ...]
    request_id: bool = True
    # Pull: pass D only NixlConnector's fields of P's answer, as routers that rebuild them do.
    nixl_fields_only: bool = False
    timeout: float = 600.0
    max_body_bytes: int = MAX_BODY_BYTES


class UpstreamError(Exception):
    """An engine that failed a leg, with the status the client gets for it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> web.Response:
    """An OpenAI-shaped error answer."""
    error = {"message": message, "type": "kvflow_proxy_error", "code": status}
    return web.json_response({"error": error}, status=status)


def pull_prefill_params() -> dict[str, Any]:
    """What P gets in pull mode: prefill, keep the blocks for a remote decode."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def push_decode_params(prefill: Prefill, request_id: str | None, transfer_id: str) -> dict[str, Any]:
    """What D gets in push mode: whose KV to expect, and the transfer that pairs it with P."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.side_host,
        "remote_port": prefill.side_port,
        "tp_size": prefill.tp_size,
        "pp_size": 1,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }


def prefill_leg(body: dict[str, Any], path: str, params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as P gets it: one token, not streamed, with ``params``."""
    leg = {key: value for key, value in body.items() if key not in PREFILL_DROPS}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=params)
    if path == CHAT:
        leg["max_completion_tokens"] = 1
    return leg


class _Reply:
    """The client's answer once its headers are sent; until then a failure can still change it."""

    response: web.StreamResponse | None = None


class Proxy:
    """The proxy's state (engines, round-robin counters, the upstream session) and its app.

    ``start`` serves it on a port of its own, for tests and embedding; ``main`` runs it."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.app = web.Application(client_max_size=config.max_body_bytes)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_post(COMPLETIONS, self._completions)
        self.app.router.add_post(CHAT, self._completions)
        self.app.cleanup_ctx.append(self._session_ctx)
        self._prefills = itertools.cycle(config.prefills)
        self._decodes = itertools.cycle(config.decodes)
        self._session: aiohttp.ClientSession | None = None
        # Push mode's P legs that outlive their request; held so they are not collected.
        self._pending: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serves the proxy on ``host:port`` (0: a free port) and returns its URL."""
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound = self._runner.addresses[0][1]
        return f"http://{host}:{bound}"

    async def stop(self) -> None:
        """Stops what ``start`` served, closing the upstream connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _session_ctx(self, app: web.Application) -> AsyncIterator[None]:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.config.timeout, sock_read=self.config.timeout
        )
        # aiohttp's default of 100 connections would queue requests behind long generations.
        connector = aiohttp.TCPConnector(limit=0)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        yield
        for task in list(self._pending):
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy's app has not started"
        return self._session

    async def _health(self, request: web.Request) -> web.Response:
        engines = {"prefill": len(self.config.prefills), "decode": len(self.config.decodes)}
        return web.json_response({"status": "ok", "mode": self.config.mode, **engines})

    async def _models(self, request: web.Request) -> web.StreamResponse:
        url = next(self._decodes) + "/v1/models"
        try:
            return await self._relay(request, _Reply(), "GET", url, None, self._headers(request, None))
        except UpstreamError as error:
            return error_response(error.status, str(error))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return error_response(413, f"request body over {self.config.max_body_bytes} bytes")
        except ValueError as error:
            return error_response(400, f"request body is not JSON: {error}")
        if not isinstance(body, dict):
            return error_response(400, "request body is not a JSON object")
        request_id = self._request_id(request)
        try:
            if self.config.mode == "push":
                return await self._push(request, body, request_id)
            return await self._pull(request, body, request_id)
        except UpstreamError as error:
            log.warning("%s %s (request %s): %s", request.method, request.path, request_id, error)
            return error_response(error.status, str(error))

    def _request_id(self, request: web.Request) -> str | None:
        if not self.config.request_id:
            return None
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    def _headers(self, request: web.Request, request_id: str | None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        return headers

    async def _pull(
        self, request: web.Request, body: dict[str, Any], request_id: str | None
    ) -> web.StreamResponse:
        """P prefills, then D decodes with P's ``kv_transfer_params``."""
        headers = self._headers(request, request_id)
        prefill = next(self._prefills)
        leg = prefill_leg(body, request.path, pull_prefill_params())
        answer = await self._prefill(prefill, request.path, leg, headers)
        params = answer.get("kv_transfer_params")
        decode_body = {key: value for key, value in body.items() if key != "kv_transfer_params"}
        if isinstance(params, dict):
            if self.config.nixl_fields_only:
                params = {key: value for key, value in params.items() if key in NIXL_FIELDS}
            decode_body["kv_transfer_params"] = params
        else:
            log.warning(
                "prefill %s gave no kv_transfer_params for request %s (is it a kv_producer?); "
                "the decode engine computes the prompt itself", prefill.url, request_id,
            )
        url = next(self._decodes) + request.path
        return await self._relay(request, _Reply(), "POST", url, decode_body, headers)

    async def _push(
        self, request: web.Request, body: dict[str, Any], request_id: str | None
    ) -> web.StreamResponse:
        """P and D at once, paired by a fresh ``transfer_id``; D's answer goes to the client."""
        headers = self._headers(request, request_id)
        prefill, decode = next(self._prefills), next(self._decodes)
        transfer_id = uuid.uuid4().hex
        p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}
        p_leg = asyncio.create_task(
            self._prefill(prefill, request.path, prefill_leg(body, request.path, p_params), headers)
        )
        p_leg.add_done_callback(lambda task: _log_push_prefill(task, request_id))
        reply = _Reply()
        decode_body = dict(body, kv_transfer_params=push_decode_params(prefill, request_id, transfer_id))
        d_leg = asyncio.create_task(
            self._relay(request, reply, "POST", decode + request.path, decode_body, headers)
        )
        try:
            await asyncio.wait({p_leg, d_leg}, return_when=asyncio.FIRST_COMPLETED)
            if not d_leg.done() and p_leg.exception() is not None:
                return await self._drop_decode(d_leg, reply, p_leg.exception())
            return await d_leg
        except BaseException:
            # The client went away or a leg failed: the other leg serves no one.
            p_leg.cancel()
            d_leg.cancel()
            raise
        finally:
            if not p_leg.done():
                self._pending.add(p_leg)
                p_leg.add_done_callback(self._pending.discard)

    async def _drop_decode(
        self, d_leg: asyncio.Task[web.StreamResponse], reply: _Reply, error: BaseException | None
    ) -> web.StreamResponse:
        """Ends D's leg after P failed: an error answer if D's had not started, else its end."""
        d_leg.cancel()
        await asyncio.wait({d_leg})
        if reply.response is None:
            raise error if error is not None else UpstreamError(502, "prefill failed")
        await _end_stream(reply.response, f"prefill failed: {error}")
        return reply.response

    async def _prefill(
        self, prefill: Prefill, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """Sends P's leg and returns its answer; raises ``UpstreamError`` naming P."""
        url = prefill.url + path
        try:
            async with self.session.post(url, json=body, headers=headers) as answer:
                text = await answer.text()
                if answer.status >= 400:
                    # A 4xx is the request's fault, and D would say the same; the rest is P's.
                    status = answer.status if answer.status < 500 else 502
                    message = f"prefill {prefill.url} answered {answer.status}: {text[:1000]}"
                    raise UpstreamError(status, message)
        except asyncio.TimeoutError:
            message = f"prefill {prefill.url} sent nothing for {self.config.timeout} s"
            raise UpstreamError(504, message) from None
        except aiohttp.ClientError as error:
            raise UpstreamError(502, f"prefill {prefill.url} failed: {_describe(error)}") from None
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamError(502, f"prefill {prefill.url} answered with no JSON object")
        return parsed

    async def _relay(
        self,
        request: web.Request,
        reply: _Reply,
        method: str,
        url: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        """Sends one request upstream and relays the answer to the client as it comes, with its
        status and content type; raises ``UpstreamError`` while nothing was sent to the client."""
        try:
            async with self.session.request(method, url, json=body, headers=headers) as upstream:
                reply.response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                content_type = upstream.headers.get("Content-Type", "application/json")
                reply.response.headers["Content-Type"] = content_type
                await reply.response.prepare(request)
                await _copy(upstream, reply.response, url)
                return reply.response
        except asyncio.TimeoutError:
            raise UpstreamError(504, f"decode {url} sent nothing for {self.config.timeout} s") from None
        except aiohttp.ClientError as error:
            if isinstance(error, ConnectionResetError):
                raise  # the client went away while its headers were sent
            raise UpstreamError(502, f"decode {url} failed: {_describe(error)}") from None


async def _copy(upstream: aiohttp.ClientResponse, reply: web.StreamResponse, url: str) -> None:
    """Copies the upstream body to the client; a client that goes away closes the upstream."""
    while True:
        try:
            chunk = await upstream.content.readany()
        except (asyncio.TimeoutError, aiohttp.ClientError) as error:
            log.warning("decode %s broke off its answer: %s", url, _describe(error))
            await _end_stream(reply, f"decode {url} broke off its answer")
            return
        if not chunk:
            break
        try:
            await reply.write(chunk)
        except ConnectionResetError:
            # Closing, not releasing, the connection is what tells vLLM to abort the request.
            upstream.close()
            return
    try:
        await reply.write_eof()
    except ConnectionResetError:
        upstream.close()


def _describe(error: BaseException) -> str:
    return str(error) or type(error).__name__


def _log_push_prefill(task: asyncio.Task[dict[str, Any]], request_id: str | None) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("push prefill leg of request %s failed: %s", request_id, task.exception())


async def _end_stream(reply: web.StreamResponse, message: str) -> None:
    """Ends an answer whose status is already sent; an SSE client gets the error as an event."""
    try:
        if reply.content_type == "text/event-stream":
            event = {"error": {"message": message, "type": "kvflow_proxy_error", "code": 502}}
            await reply.write(f"data: {json.dumps(event)}\n\n".encode())
        await reply.write_eof()
    except ConnectionResetError:
        pass


def build_app(config: ProxyConfig) -> web.Application:
    """The proxy as an aiohttp application, for ``web.run_app`` or an ``AppRunner``; serve it
    with ``handler_cancellation=True`` so that a client going away cancels its legs."""
    return Proxy(config).app


# The command line.


def parse_url(value: str) -> str:
    """A server root from ``http://host:port`` or ``host:port``, without a trailing slash."""
    url = value if "://" in value else f"http://{value}"
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad port in server URL {value!r}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or "@" in parts.netloc:
        raise argparse.ArgumentTypeError(
            f"bad server URL {value!r}: expected http://HOST:PORT, the server's root without /v1"
        )
    return url.rstrip("/")


def parse_prefill(value: str) -> Prefill:
    """A P from ``URL`` or ``URL@ENGINE_ID@SIDEHOST:SIDEPORT[@TP]``."""
    url, *coordinates = value.split("@")
    if not coordinates:
        return Prefill(parse_url(url))
    if len(coordinates) not in (2, 3) or not coordinates[0]:
        raise argparse.ArgumentTypeError(
            f"bad prefill {value!r}: expected URL or URL@ENGINE_ID@SIDEHOST:SIDEPORT[@TP]"
        )
    engine_id, side, tp = coordinates[0], coordinates[1], (coordinates[2:] or ["1"])[0]
    host, colon, port = side.rpartition(":")
    host = host.strip("[]")
    if not colon or not host:
        raise argparse.ArgumentTypeError(
            f"bad side channel {side!r} in prefill {value!r}: expected SIDEHOST:SIDEPORT"
        )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"bad side-channel port {port!r} in prefill {value!r}")
    if not tp.isdigit() or int(tp) < 1:
        raise argparse.ArgumentTypeError(f"bad tensor-parallel size {tp!r} in prefill {value!r}")
    return Prefill(parse_url(url), engine_id, host, int(port), int(tp))


def _port(value: str) -> int:
    if not value.isdigit() or not 0 <= int(value) < 65536:
        raise argparse.ArgumentTypeError(f"bad port {value!r}")
    return int(value)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"bad timeout {value!r}: expected positive seconds")
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvflow.proxy",
        description="A proxy that splits OpenAI completion requests into a prefill leg for a P "
        "and a decode leg for a D, in vLLM's pull (NixlConnector) or push (NixlPushConnector) protocol.",
    )
    parser.add_argument("--mode", required=True, choices=("pull", "push"),
                        help="pull: D reads the KV cache from P; push: P writes it into D")
    parser.add_argument("--prefill", required=True, action="append", type=parse_prefill, metavar="P",
                        help="a prefill server, repeatable: URL, or for push mode "
                        "URL@ENGINE_ID@SIDEHOST:SIDEPORT[@TP] (P's kv_transfer_config.engine_id, the "
                        "host and VLLM_NIXL_SIDE_CHANNEL_PORT of its side channel, its TP size, default 1)")
    parser.add_argument("--decode", required=True, action="append", type=parse_url, metavar="URL",
                        help="a decode server, repeatable")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", default=8000, type=_port, help="port to listen on (default 8000)")
    parser.add_argument("--no-request-id", action="store_true",
                        help="send no X-Request-Id upstream (default: the same id to both legs)")
    parser.add_argument("--nixl-fields-only", action="store_true",
                        help="pull: pass D only NixlConnector's fields of P's answer (no \"kvflow\" key), "
                        "as routers that rebuild them do")
    parser.add_argument("--timeout", default=600.0, type=_seconds, metavar="SECONDS",
                        help="longest wait for an upstream's next bytes (default 600)")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[ProxyConfig, str, int]:
    """The proxy's configuration and the address to listen on; exits with status 2 naming a
    bad value."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.mode == "push":
        for prefill in args.prefill:
            if prefill.engine_id is None:
                parser.error(
                    f"--prefill {prefill.url!r}: push mode needs P's coordinates, "
                    "URL@ENGINE_ID@SIDEHOST:SIDEPORT[@TP]"
                )
    config = ProxyConfig(
        mode=args.mode,
        prefills=tuple(args.prefill),
        decodes=tuple(args.decode),
        request_id=not args.no_request_id,
        nixl_fields_only=args.nixl_fields_only,
        timeout=args.timeout,
    )
    return config, args.host, args.port


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the proxy until interrupted."""
    config, host, port = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info(
        "%s proxy on http://%s:%d: prefill %s, decode %s", config.mode, host, port,
        ", ".join(p.url for p in config.prefills), ", ".join(config.decodes),
    )
    app = build_app(config)
    web.run_app(app, host=host, port=port, handler_cancellation=True, access_log=None, print=None)


if __name__ == "__main__":
    main()
