"""``flowcredit serve-reward``: serve registered rewards (names, ``pkg.mod:fn``, mixes) over HTTP.

    POST /score/{name}  {"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [{...}, ...]}
                        -> 200 {"rewards": [float | null, ...]}      (null: a non-finite reward)
    POST /score         the same, for the first reward served
    GET  /health        -> 200 {"status": "ok", "rewards": [...], limits}   (also /info; no token)

A Starlette app on uvicorn (with the httptools parser, which refuses duplicate Content-Length headers
and malformed requests with a 400). Concurrent requests to one reward are merged into reward calls of
at most ``max_batch`` images (batcher.py). Each request has one deadline (``timeout_s``) covering
the wait for room for its body (announced bytes, ``max_concurrency × max_body_bytes`` in all),
reading the body (within ``body_timeout_s``), the wait for one of ``max_concurrency`` scoring slots
and scoring; past it the answer is 408 (body still arriving) or 503. A slow upload holds only its own
bytes, so it does not take a scoring slot from anyone. Errors answer ``{"error": "..."}`` with no
memory address, token or file path: 400 malformed request (or a PNG over 8 bits per channel), 401
bad token, 404 unknown path or reward, 411 no Content-Length, 413 body or image over the limit
(answered before the body is read; the server keeps reading and discarding the rest, so the client
gets the answer), 422 the reward rejected the input (``ValueError``), 500 the reward failed (another
exception, ``SystemExit`` / ``KeyboardInterrupt`` inside it, or the wrong number of scores).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading

from flowcredit.errors import UserError
from flowcredit.rewards import Reward, get_reward, parse_mix
from flowcredit.rewards.app import Limits, create_app, require_stack
from flowcredit.rewards.wire import TOKEN_ENV

__all__ = ["Limits", "RunningServer", "build_rewards", "create_app", "main", "start_server"]


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket with a deep backlog: a burst of connections is queued, not dropped."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only then, and without it each answer's body waits
    # ~40 ms behind its headers (Nagle against the client's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def guarded_protocol(header_timeout_s: float):
    """uvicorn's httptools protocol with a request-head deadline, which uvicorn lacks (its keep-alive
    timer stops at the first byte): a connection that has not sent a complete request head within
    ``header_timeout_s`` of opening, or of its last answer, is closed. That ends idle connections,
    half-sent request lines, and bodies dripped after an early answer (e.g. a 401)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:  # waiting for the next request
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def _uvicorn(app, limits: Limits, quiet: bool):
    uvicorn = require_stack()
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits.header_timeout_s),
        lifespan="on",
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=5,
        log_level="warning" if quiet else "info",
        access_log=not quiet,
    )
    return uvicorn.Server(config)


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class RunningServer:
    """A reward server in a background thread (tests, benchmarks, a reward in the same process).

    ``url`` is where it listens; ``stop()`` (or leaving a ``with`` block) shuts it down.
    """

    def __init__(self, app, *, host: str, port: int, limits: Limits, quiet: bool):
        self._sock = _listen(host, port)
        self.url = _url(self._sock)
        self._server = _uvicorn(app, limits, quiet)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                self._sock.close()
                raise RuntimeError(f"reward server on {self.url} failed to start")
            self._thread.join(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(
    rewards: dict,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    limits: Limits | None = None,
    quiet: bool = True,
) -> RunningServer:
    """Serve ``rewards`` (``{name: Reward or reward_fn}``) from a background thread; port 0: any free one."""
    limits = limits or Limits()
    app = create_app(rewards, token=token, limits=limits, quiet=quiet)
    return RunningServer(app, host=host, port=port, limits=limits, quiet=quiet)


def build_rewards(specs: list[str], options: dict) -> dict[str, Reward]:
    """``{spec: Reward}`` for each ``--reward``; each gets the ``--reward-options`` entries it names."""
    if len(set(specs)) != len(specs):
        raise UserError(f"serve-reward: a --reward is given twice: {specs}")
    if not isinstance(options, dict):
        raise UserError('serve-reward: --reward-options must be a JSON object {"name": {...}}')
    mixes = {spec: parse_mix(spec) for spec in specs}
    unused = set(options) - {name for mix in mixes.values() for name in mix}
    if unused:
        raise UserError(f"serve-reward: --reward-options names {sorted(unused)}, which no --reward uses")
    return {
        spec: get_reward(spec, {k: v for k, v in options.items() if k in mix}) for spec, mix in mixes.items()
    }


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    d = Limits()
    p = argparse.ArgumentParser(prog="flowcredit serve-reward", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--reward",
        action="append",
        required=True,
        help="a reward to serve, addressed as "
        "/score/<the string given>: registry name, 'pkg.mod:fn' or mix 'a=1,b=0.5'; repeat to serve several",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--token", default=None, help=f"bearer token (prefer the env variable {TOKEN_ENV})")
    p.add_argument("--reward-options", default="", help='JSON {"name": {"option": value}}, as reward_options')
    p.add_argument(
        "--max-body-mb", type=float, default=d.max_body_bytes / (1 << 20), help="largest body, MiB"
    )
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="most images per reward call")
    p.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms, help="longest wait to fill a call")
    p.add_argument("--max-pixels", type=int, default=d.max_pixels, help="largest image, in pixels")
    p.add_argument("--max-json-values", type=int, default=d.max_json_values, help="JSON values per body")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="total seconds per request")
    p.add_argument("--body-timeout", type=float, default=d.body_timeout_s, help="seconds to receive a body")
    p.add_argument(
        "--header-timeout", type=float, default=d.header_timeout_s, help="seconds to send a request head"
    )
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency, help="requests in progress")
    p.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections")
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``flowcredit serve-reward``; blocks until interrupted."""
    args = _parser().parse_args(argv)
    token = args.token or os.environ.get(TOKEN_ENV) or None
    if token is None and not _is_loopback(args.host):
        print(
            f"serve-reward: refusing to serve on {args.host} without a token (--token or {TOKEN_ENV})",
            file=sys.stderr,
        )
        return 2
    if token is not None and len(token) < 8:
        print(
            f"serve-reward: warning: a token of {len(token)} characters is easy to guess, and error bodies "
            "scrub only tokens of 8 or more characters; use a longer one",
            file=sys.stderr,
        )
    try:
        options = json.loads(args.reward_options) if args.reward_options else {}
    except ValueError as exc:
        print(f"serve-reward: --reward-options is not JSON: {exc}", file=sys.stderr)
        return 2
    limits = Limits(
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_pixels=args.max_pixels,
        max_json_values=args.max_json_values,
        timeout_s=args.timeout,
        body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout,
        max_concurrency=args.max_concurrency,
        max_connections=args.max_connections,
    )
    app = create_app(build_rewards(args.reward, options), token=token, limits=limits, quiet=args.quiet)
    sock = _listen(args.host, args.port)
    print(f"serving rewards {args.reward} on {_url(sock)} (POST /score/NAME, GET /health)", flush=True)
    _uvicorn(app, limits, args.quiet).run(sockets=[sock])
    return 0
