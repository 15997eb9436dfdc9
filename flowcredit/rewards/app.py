"""The reward server's ASGI app (Starlette): routes, auth, limits, deadlines and status codes.

``create_app(rewards)`` serves ``{name: reward}``; server.py runs it on uvicorn (``flowcredit
serve-reward``, or :func:`flowcredit.rewards.server.start_server` in a thread). The protocol, the
limits and the status codes are in docs/rewards.md ("Remote rewards").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import traceback
from dataclasses import asdict, dataclass

from flowcredit.errors import UserError
from flowcredit.rewards import Reward, RewardOutputError
from flowcredit.rewards.batcher import Batcher
from flowcredit.rewards.wire import ServeError, parse_score_request, public_message, without_paths

EXTRA_HINT = "pip install 'flowcredit[serve]'"


@dataclass(frozen=True)
class Limits:
    """What one server accepts; ``GET /health`` advertises all of it, and the client chunks by it."""

    max_body_bytes: int = 64 << 20  # largest request body
    max_batch: int = 16  # most images per reward call (bounds decoded pixels in memory)
    max_wait_ms: float = 50.0  # longest an image waits for others to share its reward call
    max_pixels: int = 2048 * 2048  # largest image, checked in the PNG header before decoding
    timeout_s: float = 120.0  # total time for one request: queueing, reading the body and scoring
    max_concurrency: int = 16  # requests parsed and scored at once; others wait for a slot
    body_timeout_s: float = 30.0  # time to receive one body (408 past it), within timeout_s
    header_timeout_s: float = 10.0  # a connection without a complete request head this long is closed
    max_json_values: int = 100_000  # JSON values in one body (counted before parsing; bounds its memory)
    max_connections: int = 256  # open connections; beyond them uvicorn answers 503

    def __post_init__(self):
        for name, value in asdict(self).items():
            if not value > 0:
                raise UserError(f"serve-reward: {name} must be positive, got {value}")


def require_stack():
    """Import the serving stack, or name the missing extra."""
    try:
        import httptools  # noqa: F401  (uvicorn's parser; refuses duplicate Content-Length)
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise UserError(f"serving rewards needs {exc.name!r}, which is not installed: {EXTRA_HINT}") from None
    return uvicorn


def _total(reward):
    """A :class:`Reward` (a mix) as a plain ``reward_fn`` returning the total; thread-safe."""
    if isinstance(reward, Reward):
        return lambda images, prompts, metadata: reward.score(images, prompts, metadata)[0]
    return reward


class RewardService:
    """The served rewards, their batchers and limits, with the checks that need no HTTP library."""

    def __init__(self, rewards: dict, *, token: str | None, limits: Limits, quiet: bool):
        if not rewards:
            raise UserError("serve-reward: no reward to serve")
        self.fns = {name: _total(fn) for name, fn in rewards.items()}
        self.default = next(iter(rewards))
        self.token, self.limits, self.quiet = token, limits, quiet
        self.batchers: dict[str, Batcher] = {}
        self.slots: asyncio.Semaphore | None = None
        self.bodies: ByteBudget | None = None

    def start(self) -> None:
        """Create the batchers and the slot semaphore in the running event loop."""
        wait = self.limits.max_wait_ms / 1000
        self.batchers = {name: Batcher(fn, self.limits.max_batch, wait) for name, fn in self.fns.items()}
        for batcher in self.batchers.values():
            batcher.start()
        self.slots = asyncio.Semaphore(self.limits.max_concurrency)
        self.bodies = ByteBudget(self.limits.max_concurrency * self.limits.max_body_bytes)

    async def stop(self) -> None:
        """Stop the batchers' workers (at shutdown)."""
        for batcher in self.batchers.values():
            await batcher.stop()

    def info(self) -> dict:
        """``GET /health``: the rewards, the limits, and how many reward calls each has made."""
        calls = {name: b.calls for name, b in self.batchers.items()}
        served = {"rewards": list(self.fns), "reward": self.default}
        return {"status": "ok", **served, **asdict(self.limits), "reward_calls": calls}

    def check_auth(self, header: str | None) -> None:
        """``Authorization: Bearer <token>`` (scheme in any case, token compared in constant time)."""
        if self.token is None:
            return
        scheme, _, given = (header or "").strip().partition(" ")
        same = hmac.compare_digest(given.strip().encode("latin-1", "replace"), self.token.encode())
        if not (same and scheme.lower() == "bearer"):
            raise ServeError(401, "missing or wrong bearer token")

    def batcher(self, name: str) -> Batcher:
        """The batcher of reward ``name``; 404 if this server does not serve it."""
        if name not in self.batchers:
            raise ServeError(404, f"no reward {name!r} here; served: {list(self.fns)}")
        return self.batchers[name]

    def body_length(self, headers) -> int:
        """The request's Content-Length, checked against the limit before the body is read."""
        if "transfer-encoding" in headers:
            raise ServeError(411, "chunked bodies are not accepted; send a Content-Length")
        values = headers.getlist("content-length")
        if not values:
            raise ServeError(411, "Content-Length required")
        if len(values) > 1 or not values[0].strip().isdigit():
            raise ServeError(400, f"bad Content-Length {', '.join(values)!r}")
        n = int(values[0])
        if n > self.limits.max_body_bytes:
            raise ServeError(413, f"body of {n} bytes exceeds max_body_bytes {self.limits.max_body_bytes}")
        return n

    def error_status(self, name: str, exc: Exception) -> tuple[int, str]:
        """Status and message for a failed request (4xx: the caller's fault; 500: the reward's)."""
        if isinstance(exc, ServeError):
            return exc.status, str(exc)
        if isinstance(exc, RewardOutputError):
            return 500, f"reward {name!r} is broken: {without_paths(str(exc))}"
        if isinstance(exc, ValueError):
            return 422, f"reward {name!r} rejected the input: {without_paths(str(exc))}"
        if not self.quiet:  # the server's log keeps the whole text, paths included
            traceback.print_exception(type(exc), exc, exc.__traceback__)
        return 500, f"reward {name!r} failed: {type(exc).__name__}: {without_paths(str(exc))}"


async def _read_body(request, n: int) -> bytearray:
    """The body, which must be exactly the ``n`` bytes Content-Length announced; 400 otherwise."""
    from starlette.requests import ClientDisconnect

    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
    except ClientDisconnect:
        raise ServeError(400, f"client went away after {len(body)} of {n} bytes") from None
    if len(body) != n:
        raise ServeError(400, f"body of {len(body)} bytes, Content-Length said {n}")
    return body


class ByteBudget:
    """Bytes of request bodies held at once (announced Content-Lengths): a body is read only when its
    length fits, and counts until its request is answered. The memory bound of the raw bodies is the
    budget (``max_concurrency × max_body_bytes``), as when a body needed a scoring slot; but a slow
    client now holds only its own announced bytes, not one of the ``max_concurrency`` slots."""

    def __init__(self, total: int):
        self.free, self._changed = total, asyncio.Condition()

    @contextlib.asynccontextmanager
    async def hold(self, n: int):
        async with self._changed:
            await self._changed.wait_for(lambda: self.free >= n)
            self.free -= n
        try:
            yield
        finally:
            async with self._changed:
                self.free += n
                self._changed.notify_all()


async def _score(service: RewardService, request, name: str) -> list:
    """Checks, then under one deadline: room for the body, the body (under its own deadline), a
    scoring slot, parsing and the batched reward call."""
    import anyio

    service.check_auth(request.headers.get("authorization"))
    batcher = service.batcher(name)
    n = service.body_length(request.headers)
    limits, phase = service.limits, "waiting for room for the body"
    try:
        with anyio.fail_after(limits.timeout_s) as deadline:
            async with service.bodies.hold(n):
                phase = "reading the body"
                with anyio.fail_after(limits.body_timeout_s) as body_deadline:
                    body = await _read_body(request, n)
                phase = "waiting for a free slot"
                async with service.slots:
                    phase = "scoring"
                    parsed = await anyio.to_thread.run_sync(
                        parse_score_request, body, limits.max_pixels, limits.max_json_values
                    )
                    del body
                    client = request.client
                    return await batcher.score(parsed, None if client is None else (client.host, client.port))
    except TimeoutError:
        if phase == "reading the body" and body_deadline.cancel_called:
            raise ServeError(
                408, f"body not received within body_timeout_s={limits.body_timeout_s}"
            ) from None
        if not deadline.cancel_called:  # raised by the reward itself: its failure, not ours
            raise
        status = 408 if phase == "reading the body" else 503
        raise ServeError(status, f"request took over timeout_s={limits.timeout_s} ({phase})") from None


def create_app(rewards: dict, *, token: str | None = None, limits: Limits | None = None, quiet: bool = False):
    """The Starlette app serving ``rewards`` (``{name: Reward or reward_fn}``; the first is the default)."""
    require_stack()
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    service = RewardService(rewards, token=token, limits=limits or Limits(), quiet=quiet)

    def error(status: int, message: str) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
        if status == 408:  # the body never arrived: drop the connection rather than drain it
            headers["Connection"] = "close"
        elif status == 503:
            headers["Retry-After"] = "1"
        return JSONResponse({"error": public_message(message, (token or "",))}, status, headers)

    async def health(request):
        return JSONResponse(service.info())

    async def score(request):
        name = request.path_params.get("name", service.default)
        try:
            return JSONResponse({"rewards": await _score(service, request, name)})
        except Exception as exc:
            return error(*service.error_status(name, exc))

    async def http_error(request, exc):
        return error(
            exc.status_code,
            f"{exc.detail}: {request.method} {request.url.path}; "
            "use GET /health, POST /score or /score/{name}",
        )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.start()
        yield
        await service.stop()

    routes = [Route(p, health, methods=["GET"]) for p in ("/health", "/info")]
    routes += [Route(p, score, methods=["POST"]) for p in ("/score", "/score/{name}")]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.service = service
    return app
