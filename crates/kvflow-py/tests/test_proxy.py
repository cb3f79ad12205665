"""kvflow's proxy (``kvflow/proxy.py``) between fake P and D servers that answer like vLLM's
OpenAI server: what each leg carries in pull and push mode, streaming, round robin, request
ids, failures and bounds, and the command line.

The module is loaded from its file, so these tests need neither the native extension nor a
rebuilt wheel; everything runs on localhost in one event loop per test."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import pathlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

PROXY_PY = pathlib.Path(__file__).parents[1] / "python" / "kvflow" / "proxy.py"
_spec = importlib.util.spec_from_file_location("kvflow_proxy_under_test", PROXY_PY)
assert _spec is not None and _spec.loader is not None
proxy = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = proxy  # dataclasses look their module up there
_spec.loader.exec_module(proxy)


@dataclass
class Seen:
    """One request a fake engine received."""

    name: str
    path: str
    headers: dict[str, str]  # names in lower case
    body: dict[str, Any]
    at: float


@dataclass
class FakeEngine:
    """A stand-in for one vLLM OpenAI server, P or D by its name's first letter.

    P answers a one-token completion with ``kv_transfer_params`` when asked to prefill for a
    remote decode; D answers ``"decoded by <name>"`` as JSON or as an SSE stream of one word a
    chunk. ``delay`` holds the answer back, ``fail`` lists statuses for the next answers,
    ``endless`` makes D stream until the reader goes away."""

    name: str
    seen: list[Seen]
    delay: float = 0.0
    fail: list[int] = field(default_factory=list)
    give_params: bool = True
    chunk_delay: float = 0.0
    endless: bool = False
    answered_at: list[float] = field(default_factory=list)
    last_chunk_at: float = 0.0
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "served_by": self.name}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        headers = {key.lower(): value for key, value in request.headers.items()}
        self.seen.append(Seen(self.name, request.path, headers, body, time.monotonic()))
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                status = self.fail.pop(0)
                return web.json_response({"error": {"message": "boom", "code": status}}, status=status)
            if self.name.startswith("P"):
                return self._prefilled(request.path, body)
            if body.get("stream"):
                return await self._stream(request)
            return web.json_response(_answer(request.path, f"decoded by {self.name}"))
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        finally:
            self.answered_at.append(time.monotonic())

    def _prefilled(self, path: str, body: dict[str, Any]) -> web.Response:
        answer = _answer(path, "x")
        if self.give_params and body.get("kv_transfer_params", {}).get("do_remote_decode"):
            answer["kv_transfer_params"] = produced_params(self.name)
        return web.json_response(answer)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await reply.prepare(request)
        words = ["decoded", "by", self.name]
        index = 0
        while index < len(words) or self.endless:
            chunk = {"choices": [{"index": 0, "text": words[index % len(words)]}]}
            await reply.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.last_chunk_at = time.monotonic()
            index += 1
            await asyncio.sleep(self.chunk_delay)
        await reply.write(b"data: [DONE]\n\n")
        await reply.write_eof()
        return reply


def produced_params(name: str) -> dict[str, Any]:
    """What fake P ``name`` answers a prefill for a remote decode with: NixlConnector's fields
    and kvflow's own."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [3, 4, 5],
        "remote_engine_id": f"engine-{name}",
        "remote_request_id": "cmpl-from-p",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "kvflow": {"export": 17, "producer": name},
    }


def _answer(path: str, text: str) -> dict[str, Any]:
    if path.endswith("/chat/completions"):
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        return {"id": "chatcmpl-1", "object": "chat.completion", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": "length"}
    return {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}


@dataclass
class Cluster:
    """The proxy, its fake engines, everything they saw, and a client."""

    url: str
    prefills: list[FakeEngine]
    decodes: list[FakeEngine]
    seen: list[Seen]
    client: aiohttp.ClientSession

    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        async with self.client.post(self.url + path, json=body, headers=headers) as reply:
            text = await reply.text()
            try:
                return reply.status, json.loads(text)
            except ValueError:
                return reply.status, text

    def legs(self, kind: str) -> list[Seen]:
        return [seen for seen in self.seen if seen.name.startswith(kind)]


@contextlib.asynccontextmanager
async def cluster(
    mode: str,
    prefills: int = 1,
    decodes: int = 1,
    p: dict[str, Any] | None = None,
    d: dict[str, Any] | None = None,
    **config: Any,
) -> AsyncIterator[Cluster]:
    """The proxy in ``mode`` before fake engines; ``p`` and ``d`` set up the fakes. P number i
    has engine id ``engine-Pi``, side channel ``10.0.0.i:560i`` and TP 2."""
    seen: list[Seen] = []
    ps = [FakeEngine(f"P{i}", seen, **(p or {})) for i in range(prefills)]
    ds = [FakeEngine(f"D{i}", seen, **(d or {})) for i in range(decodes)]
    for engine in ps + ds:
        await engine.start()
    coordinates = [proxy.Prefill(e.url, f"engine-{e.name}", f"10.0.0.{i}", 5600 + i, 2) for i, e in enumerate(ps)]
    server = proxy.Proxy(proxy.ProxyConfig(mode, tuple(coordinates), tuple(e.url for e in ds), **config))
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as client:
            yield Cluster(url, ps, ds, seen, client)
    finally:
        await server.stop()
        for engine in ps + ds:
            await engine.stop()


def run(scenario: Any) -> None:
    asyncio.run(asyncio.wait_for(scenario, 20))


def test_pull_with_nixl_fields_only_passes_d_what_a_rebuilding_router_does() -> None:
    async def scenario() -> None:
        async with cluster("pull", nixl_fields_only=True) as c:
            status, answer = await c.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
            assert status == 200, answer
            (d_leg,) = c.legs("D")
            expected = {k: v for k, v in produced_params("P0").items() if k in proxy.NIXL_FIELDS}
            assert d_leg.body["kv_transfer_params"] == expected
            assert "kvflow" not in d_leg.body["kv_transfer_params"] and expected

    run(scenario())


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 9, "min_tokens": 3}),
        ("/v1/chat/completions",
         {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}),
    ],
)
def test_pull_prefills_on_p_then_decodes_on_d_with_p_params(path: str, body: dict[str, Any]) -> None:
    async def scenario() -> None:
        async with cluster("pull") as c:
            status, answer = await c.post(path, dict(body, n=2))
            assert status == 200, answer
            choice = answer["choices"][0]
            assert choice.get("text", choice.get("message", {}).get("content")) == "decoded by D0"

            (p_leg,) = c.legs("P")
            assert p_leg.path == path
            assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
            assert p_leg.body["kv_transfer_params"]["do_remote_decode"] is True
            assert p_leg.body["kv_transfer_params"]["do_remote_prefill"] is False
            assert "n" not in p_leg.body and "min_tokens" not in p_leg.body
            if "messages" in body:
                assert p_leg.body["max_completion_tokens"] == 1

            (d_leg,) = c.legs("D")
            assert d_leg.body["kv_transfer_params"] == produced_params("P0")
            assert d_leg.body["kv_transfer_params"]["kvflow"] == {"export": 17, "producer": "P0"}
            assert {k: v for k, v in d_leg.body.items() if k != "kv_transfer_params"} == dict(body, n=2)
            assert d_leg.at >= p_leg.at

    run(scenario())


def test_pull_streams_d_answer_as_it_comes() -> None:
    async def scenario() -> None:
        async with cluster("pull", d={"chunk_delay": 0.2}) as c:
            body = {"prompt": "hello", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
            events = []
            first_at = 0.0
            async with c.client.post(c.url + "/v1/completions", json=body) as reply:
                assert reply.status == 200
                assert reply.content_type == "text/event-stream"
                async for line in reply.content:
                    if line.strip():
                        first_at = first_at or time.monotonic()
                        events.append(line.decode().strip())
            texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1]]
            assert texts == ["decoded", "by", "D0"]
            assert events[-1] == "data: [DONE]"
            assert first_at < c.decodes[0].last_chunk_at, "the first chunk waited for D's last"

            (p_leg,) = c.legs("P")
            assert p_leg.body["stream"] is False and "stream_options" not in p_leg.body
            (d_leg,) = c.legs("D")
            assert d_leg.body["stream"] is True and d_leg.body["stream_options"] == {"include_usage": True}

    run(scenario())


def test_push_sends_both_legs_at_once_paired_by_transfer_id() -> None:
    async def scenario() -> None:
        async with cluster("push", p={"delay": 1.0}) as c:
            status, answer = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 7, "stream": False})
            assert status == 200 and answer["choices"][0]["text"] == "decoded by D0"
            for _ in range(100):
                if c.prefills[0].answered_at:
                    break
                await asyncio.sleep(0.05)
            (p_leg,), (d_leg,) = c.legs("P"), c.legs("D")
            assert d_leg.at < c.prefills[0].answered_at[0], "D's leg waited for P's answer"

            p_params, d_params = p_leg.body["kv_transfer_params"], d_leg.body["kv_transfer_params"]
            assert p_params["do_remote_decode"] is True and p_params["do_remote_prefill"] is False
            assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
            assert len(p_params["transfer_id"]) >= 16
            request_id = p_leg.headers["x-request-id"]
            assert d_params == {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "engine-P0",
                "remote_host": "10.0.0.0",
                "remote_port": 5600,
                "tp_size": 2,
                "pp_size": 1,
                "remote_request_id": request_id,
                "transfer_id": p_params["transfer_id"],
            }
            assert d_leg.body["max_tokens"] == 7

            await c.post("/v1/completions", {"prompt": "again", "max_tokens": 7})
            transfer_ids = {leg.body["kv_transfer_params"]["transfer_id"] for leg in c.legs("P")}
            assert len(transfer_ids) == 2, "a transfer id was reused"

    run(scenario())


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_round_robin_over_two_p_and_two_d(mode: str) -> None:
    async def scenario() -> None:
        async with cluster(mode, prefills=2, decodes=2) as c:
            answers = [await c.post("/v1/completions", {"prompt": str(i), "max_tokens": 3}) for i in range(4)]
            assert [a["choices"][0]["text"] for _, a in answers] == [f"decoded by D{i % 2}" for i in range(4)]
            assert [leg.name for leg in c.legs("P")] == ["P0", "P1", "P0", "P1"]
            if mode == "push":
                engines = [leg.body["kv_transfer_params"]["remote_engine_id"] for leg in c.legs("D")]
                assert engines == ["engine-P0", "engine-P1", "engine-P0", "engine-P1"]

    run(scenario())


@pytest.mark.parametrize(
    "mode, request_id, sent, expected",
    [
        ("pull", True, None, "fresh"),
        ("pull", True, "client-id-1", "client-id-1"),
        ("push", True, "client-id-2", "client-id-2"),
        ("pull", False, "client-id-3", None),
        ("push", False, None, None),
    ],
)
def test_request_id_header(mode: str, request_id: bool, sent: str | None, expected: str | None) -> None:
    async def scenario() -> None:
        async with cluster(mode, request_id=request_id) as c:
            headers = {"X-Request-Id": sent} if sent else None
            status, _ = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2}, headers)
            assert status == 200
            (p_leg,), (d_leg,) = c.legs("P"), c.legs("D")
            p_id, d_id = p_leg.headers.get("x-request-id"), d_leg.headers.get("x-request-id")
            assert p_id == d_id
            if expected == "fresh":
                assert p_id and len(p_id) >= 16
            else:
                assert p_id == expected
            if mode == "push":
                assert d_leg.body["kv_transfer_params"]["remote_request_id"] == p_id

    run(scenario())


@pytest.mark.parametrize("p_status, client_status", [(500, 502), (400, 400)])
def test_failing_p_gives_an_error_naming_it_and_the_proxy_keeps_serving(p_status: int, client_status: int) -> None:
    async def scenario() -> None:
        async with cluster("pull", p={"fail": [p_status]}) as c:
            status, answer = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert status == client_status
            message = answer["error"]["message"]
            assert c.prefills[0].url in message and str(p_status) in message
            assert c.legs("D") == []

            status, answer = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert status == 200 and answer["choices"][0]["text"] == "decoded by D0"

    run(scenario())


def test_push_p_failure_drops_the_waiting_d_leg() -> None:
    async def scenario() -> None:
        async with cluster("push", p={"fail": [500]}, d={"delay": 10.0}) as c:
            started = time.monotonic()
            status, answer = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert time.monotonic() - started < 3
            assert status == 502 and c.prefills[0].url in answer["error"]["message"]
            await asyncio.wait_for(c.decodes[0].disconnected.wait(), 3)

    run(scenario())


def test_p_without_kv_transfer_params_lets_d_compute_the_prompt(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with cluster("pull", p={"give_params": False}) as c:
            status, answer = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert status == 200 and answer["choices"][0]["text"] == "decoded by D0"
            (d_leg,) = c.legs("D")
            assert "kv_transfer_params" not in d_leg.body

    with caplog.at_level(logging.WARNING, logger="kvflow.proxy"):
        run(scenario())
    assert any("no kv_transfer_params" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_upstream_timeout_gives_504() -> None:
    async def scenario() -> None:
        async with cluster("pull", p={"delay": 5.0}, timeout=0.3) as c:
            started = time.monotonic()
            status, answer = await c.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
            assert status == 504 and c.prefills[0].url in answer["error"]["message"]
            assert time.monotonic() - started < 3

    run(scenario())


def test_client_going_away_closes_d_leg() -> None:
    async def scenario() -> None:
        async with cluster("pull", d={"endless": True, "chunk_delay": 0.05}) as c:
            body = {"prompt": "hello", "max_tokens": 1000, "stream": True}
            reply = await c.client.post(c.url + "/v1/completions", json=body)
            assert (await reply.content.readline()).startswith(b"data: ")
            reply.close()
            await asyncio.wait_for(c.decodes[0].disconnected.wait(), 3)

    run(scenario())


def test_request_body_over_the_limit_gets_413() -> None:
    async def scenario() -> None:
        async with cluster("pull", max_body_bytes=1024) as c:
            status, _ = await c.post("/v1/completions", {"prompt": "x" * 4096, "max_tokens": 2})
            assert status == 413
            assert c.seen == []
            status, _ = await c.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 200

    run(scenario())


def test_other_routes() -> None:
    async def scenario() -> None:
        async with cluster("pull") as c:
            async with c.client.get(c.url + "/health") as reply:
                assert reply.status == 200
            async with c.client.get(c.url + "/v1/models") as reply:
                assert reply.status == 200 and (await reply.json())["data"][0]["served_by"] == "D0"
            async with c.client.post(c.url + "/v1/embeddings", json={}) as reply:
                assert reply.status == 404
            status, _ = await c.post("/v1/completions", ["not", "an", "object"])  # type: ignore[arg-type]
            assert status == 400

    run(scenario())


GOOD = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--mode", "push", *GOOD], "'http://127.0.0.1:8100'"),
        (["--mode", "sideways", *GOOD], "'sideways'"),
        (["--mode", "pull", "--prefill", "http://p:8100/v1", "--decode", "d:8200"], "'http://p:8100/v1'"),
        (["--mode", "pull", "--prefill", "ftp://p:8100", "--decode", "d:8200"], "'ftp://p:8100'"),
        (["--mode", "pull", "--prefill", "p:81x0", "--decode", "d:8200"], "'p:81x0'"),
        (["--mode", "push", "--prefill", "p:8100@eng@host:side", "--decode", "d:8200"], "'side'"),
        (["--mode", "push", "--prefill", "p:8100@eng@host:5600@0", "--decode", "d:8200"], "'0'"),
        (["--mode", "push", "--prefill", "p:8100@eng", "--decode", "d:8200"], "'p:8100@eng'"),
        (["--mode", "pull", *GOOD, "--timeout", "-1"], "'-1'"),
        (["--mode", "pull", *GOOD, "--port", "70000"], "'70000'"),
        (["--mode", "pull", "--prefill", "p:8100"], "--decode"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        proxy.main(args)
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_good_arguments_parse() -> None:
    config, host, port = proxy.parse_args(
        ["--mode", "push", "--prefill", "p0:8100@prefill-0@[fd00::1]:5600@4", "--prefill", "http://p1:8101/@prefill-1@10.0.0.2:5601",
         "--decode", "d0:8200", "--no-request-id", "--timeout", "30", "--port", "0"]
    )
    assert config.prefills[0] == proxy.Prefill("http://p0:8100", "prefill-0", "fd00::1", 5600, 4)
    assert config.prefills[1] == proxy.Prefill("http://p1:8101", "prefill-1", "10.0.0.2", 5601, 1)
    assert config.decodes == ("http://d0:8200",)
    assert (config.request_id, config.timeout, host, port) == (False, 30.0, "127.0.0.1", 0)


def test_command_line_from_the_file_refuses_bad_arguments() -> None:
    done = subprocess.run(
        [sys.executable, str(PROXY_PY), "--mode", "pull", "--prefill", "http://p:8100/v1", "--decode", "d:1"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2
    assert "'http://p:8100/v1'" in done.stderr and "Traceback" not in done.stderr
