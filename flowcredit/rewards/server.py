"""``flowcredit serve-reward``: serve registered rewards (names, ``pkg.mod:fn``, mixes) over HTTP.

    POST /score/{name}  {"images": [base64 PNG, ...], "prompts": [str, ...], "metadata": [{...}, ...]}
                        -> 200 {"rewards": [float | null, ...]}      (null: a non-finite reward)
    POST /score         the same, for the first reward served
    GET  /health        -> 200 {"status": "ok", "rewards": [...], limits}   (also /info; no token)

A Starlette app on uvicorn (with the httptools parser, which refuses duplicate Content-Length headers
and malformed requests with a 400), behind flowcredit's connection protocol (connections.py: request
heads bounded in time, bytes and lines; connections admitted per client address and in all).
Concurrent requests to one reward are merged into reward calls of at most ``max_batch`` images
(batcher.py). Each request has one deadline (``timeout_s``) covering reading the body (within
``body_timeout_s``; its bytes are charged to a budget of ``max_concurrency × max_body_bytes`` as they
arrive), the wait for one of ``max_concurrency`` scoring slots and scoring; past it the answer is 408
(body still arriving) or 503. Errors answer ``{"error": "..."}``: 400 malformed request (or a PNG
that is not 8-bit), 401 bad token, 404 unknown path or reward, 411 no Content-Length, 413 body, text
or image over the limit (a body's Content-Length is checked before it is read), 415 not JSON, 422
the reward rejected the input, 431 request head too large, 500 the reward failed, 503 busy. A 4xx
message names the culprit (a field, ``images[k]``, where the JSON breaks), and so does a 422 for a
reward's :class:`~flowcredit.rewards.RewardInputError` (``metadata[0]: ...``: its text is written for
the client). Any other exception of a reward is named by its type and an error id, never its text,
which goes to the log (docs/rewards.md, "Remote rewards").
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import sys
import threading

from flowcredit.cli_args import ArgParser
from flowcredit.errors import UserError
from flowcredit.rewards import Reward, get_reward, parse_mix
from flowcredit.rewards.app import Limits, create_app, require_stack
from flowcredit.rewards.connections import Admission, guarded_protocol
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


def _uvicorn(app, limits: Limits, quiet: bool, trusted_proxies: str | None = None):
    """The uvicorn server of ``app``. Connections are admitted by flowcredit's protocol (per address
    and in all), so uvicorn's own ``limit_concurrency``, which refuses requests on connections already
    open, is off. ``X-Forwarded-For`` is read only from ``trusted_proxies`` (uvicorn trusts 127.0.0.1
    by default, which would let any local client name itself)."""
    uvicorn = require_stack()
    config = uvicorn.Config(
        app,
        http=guarded_protocol(limits, Admission(limits)),
        ws="none",
        lifespan="on",
        limit_concurrency=None,
        timeout_keep_alive=5,
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=trusted_proxies or "",
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

    def __init__(self, app, *, host: str, port: int, limits: Limits, quiet: bool, trusted_proxies=None):
        self._sock = _listen(host, port)
        self.url = _url(self._sock)
        self._server = _uvicorn(app, limits, quiet, trusted_proxies)
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
    trusted_proxies: str | None = None,
) -> RunningServer:
    """Serve ``rewards`` (``{name: Reward or reward_fn}``) from a background thread; port 0: any free one.
    ``trusted_proxies``: addresses whose ``X-Forwarded-For`` is believed (comma-separated)."""
    limits = limits or Limits()
    app = create_app(rewards, token=token, limits=limits, quiet=quiet)
    return RunningServer(
        app, host=host, port=port, limits=limits, quiet=quiet, trusted_proxies=trusted_proxies
    )


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


LIMIT_FLAGS = [  # flag, Limits field, type, unit (field = flag value × unit), meaning
    ("--max-body-mb", "max_body_bytes", float, 1 << 20, "largest body, MiB"),
    ("--max-batch", "max_batch", int, 1, "most images per reward call"),
    ("--max-wait-ms", "max_wait_ms", float, 1, "longest wait to fill a call"),
    ("--max-pixels", "max_pixels", int, 1, "largest image, in pixels"),
    ("--max-json-values", "max_json_values", int, 1, "JSON values per body"),
    ("--max-text-kb", "max_text_bytes", float, 1 << 10, "KiB of a body outside its images"),
    ("--timeout", "timeout_s", float, 1, "total seconds per request"),
    ("--body-timeout", "body_timeout_s", float, 1, "seconds to receive a body"),
    ("--header-timeout", "header_timeout_s", float, 1, "seconds to send a request head"),
    ("--max-header-bytes", "max_header_bytes", int, 1, "largest request head, bytes"),
    ("--max-headers", "max_headers", int, 1, "most header lines in a request head"),
    ("--max-concurrency", "max_concurrency", int, 1, "requests parsed and scored at once"),
    ("--max-connections", "max_connections", int, 1, "open connections in all"),
    ("--max-client-connections", "max_client_connections", int, 1, "open connections per client address"),
    ("--max-client-connects-per-s", "max_client_connects_per_s", float, 1, "new connections/s per address"),
]


def _parser() -> argparse.ArgumentParser:
    d = Limits()
    p = ArgParser(prog="flowcredit serve-reward", description=__doc__.split("\n\n")[0])
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
    for flag, field, kind, unit, meaning in LIMIT_FLAGS:
        default = getattr(d, field) / unit
        p.add_argument(flag, type=kind, default=kind(default), help=f"{meaning} (default {kind(default)})")
    p.add_argument(
        "--trusted-proxies",
        default=None,
        help="comma-separated addresses whose X-Forwarded-For names the client (default: none)",
    )
    p.add_argument("--quiet", action="store_true", help="do not log each request")
    return p


def _limits(args) -> Limits:
    """The :class:`Limits` the flags give (each field in its own unit and type)."""
    d = Limits()
    values = {
        field: getattr(args, flag[2:].replace("-", "_")) * unit for flag, field, _, unit, _ in LIMIT_FLAGS
    }
    return Limits(**{field: type(getattr(d, field))(value) for field, value in values.items()})


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
    limits = _limits(args)
    app = create_app(build_rewards(args.reward, options), token=token, limits=limits, quiet=args.quiet)
    sock = _listen(args.host, args.port)
    print(f"serving rewards {args.reward} on {_url(sock)} (POST /score/NAME, GET /health)", flush=True)
    _uvicorn(app, limits, args.quiet, args.trusted_proxies).run(sockets=[sock])
    return 0
