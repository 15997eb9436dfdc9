"""The reward server's ASGI app (Starlette): routes, auth, limits, deadlines and status codes.

``create_app(rewards)`` serves ``{name: reward}``; server.py runs it on uvicorn (``flowcredit
serve-reward``, or :func:`flowcredit.rewards.server.start_server` in a thread). The protocol, the
limits and the status codes are in docs/rewards.md ("Remote rewards").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from dataclasses import asdict, dataclass

from flowcredit.errors import UserError
from flowcredit.rewards import Reward, RewardInputError, RewardOutputError
from flowcredit.rewards.batcher import Batcher, RewardAborted
from flowcredit.rewards.wire import ServeError, parse_score_request, public_message

LOG = logging.getLogger("uvicorn.error")  # configured by uvicorn, and shown at --quiet's level too

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
    max_text_bytes: int = 1 << 20  # bytes of a body outside its images: prompts, metadata, JSON syntax
    max_connections: int = 256  # open connections in all (connections.py: who is refused or closed)
    max_header_bytes: int = 16 << 10  # one request head (request line and headers); past it 431
    max_headers: int = 100  # header lines in one request head; past it 431
    max_client_connections: int = 64  # open connections from one client address
    max_client_connects_per_s: float = 64.0  # new connections a second from one address (1 s burst)

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
        self.bodies = ByteBudget(
            self.limits.max_concurrency * self.limits.max_body_bytes, self.limits.max_body_bytes
        )

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

    def check_content_type(self, headers) -> None:
        """A body is JSON: ``Content-Type: application/json`` (any parameters), or none at all."""
        given = headers.get("content-type")
        if given is not None and given.partition(";")[0].strip().lower() != "application/json":
            raise ServeError(415, f"Content-Type {given[:100]!r} refused; send application/json")

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
        """Status and message for a failed request (4xx: the caller's fault; 500: the reward's).

        The request's own faults are said in full: :class:`ServeError` (the server's checks) and
        :class:`RewardInputError` (a reward's input check, naming the field, the sample and the
        reason, 422). Any other exception of a reward is named by its type and an error id only: its
        text may hold paths, data or secrets. The log (shown with ``--quiet`` too) keeps the whole
        text under that id."""
        if isinstance(exc, ServeError):
            return exc.status, str(exc)
        if isinstance(exc, RewardInputError):  # written for the caller, about its own input only
            LOG.warning("reward %r rejected the input: %s", name, exc)
            return 422, f"reward {name!r} rejected {exc}"
        error_id = secrets.token_hex(4)
        kind = exc.kind if isinstance(exc, RewardAborted) else type(exc).__name__
        see = f"(error id {error_id}; the server's log has the details)"
        if isinstance(exc, ValueError) and not isinstance(exc, RewardOutputError):  # the input: one line
            LOG.warning("reward %r rejected the input, error id %s: %s: %s", name, error_id, kind, exc)
            return 422, f"reward {name!r} rejected the input: {kind} {see}"
        LOG.error(
            "reward %r failed, error id %s", name, error_id, exc_info=(type(exc), exc, exc.__traceback__)
        )
        if isinstance(exc, RewardOutputError):  # flowcredit's own message: counts and type names
            return 500, f"reward {name!r} is broken: {exc} {see}"
        return 500, f"reward {name!r} failed: {kind} {see}"


async def _read_body(request, n: int, account: Account) -> bytearray:
    """The body, which must be exactly the ``n`` bytes Content-Length announced (400 otherwise); each
    chunk is charged to the byte budget as it arrives, waiting for room if need be."""
    from starlette.requests import ClientDisconnect

    body = bytearray()
    try:
        async for chunk in request.stream():
            if chunk:
                await account.take(len(chunk))
                body += chunk
    except ClientDisconnect:
        raise ServeError(400, f"client went away after {len(body)} of {n} bytes") from None
    account.done()
    if len(body) != n:
        raise ServeError(400, f"body of {len(body)} bytes, Content-Length said {n}")
    return body


class ByteBudget:
    """Bytes of request bodies held at once, charged as they *arrive* (announcing 64 MiB and sending
    10 bytes holds 10 bytes), and held until the request is answered. A chunk waits while the budget
    is spent, except that the oldest body still arriving may overdraw it by up to ``largest``: that one
    always completes, so uploads that together exceed the budget cannot all wait on each other. Raw
    bodies in memory: at most ``total + largest``."""

    def __init__(self, total: int, largest: int):
        self.free, self.largest = total, largest
        self.reading: dict[Account, None] = {}  # bodies still arriving, oldest first
        self._wake = asyncio.Event()

    @contextlib.asynccontextmanager
    async def account(self):
        """One request's account (:class:`Account`); what it took is returned when the block ends."""
        account = Account(self)
        self.reading[account] = None
        try:
            yield account
        finally:  # synchronous: a cancelled request cannot skip it
            self.reading.pop(account, None)
            self.free += account.held
            self.notify()

    def fits(self, account: Account, n: int) -> bool:
        oldest = next(iter(self.reading), None) is account
        return self.free >= n or (oldest and self.free - n >= -self.largest)

    def notify(self) -> None:
        """Wake every waiting chunk (each checks again whether it fits)."""
        self._wake.set()
        self._wake = asyncio.Event()


class Account:
    """The bytes one request holds in a :class:`ByteBudget`."""

    def __init__(self, budget: ByteBudget):
        self.budget, self.held = budget, 0

    async def take(self, n: int) -> None:
        """Charge ``n`` more bytes, once they fit."""
        while not self.budget.fits(self, n):
            await self.budget._wake.wait()
        self.budget.free -= n
        self.held += n

    def done(self) -> None:
        """The whole body has arrived: the next oldest body may now overdraw."""
        self.budget.reading.pop(self, None)
        self.budget.notify()


async def _score(service: RewardService, request, name: str) -> list:
    """Checks, then under one deadline: the body (under its own deadline, charged to the byte budget
    as it arrives), a scoring slot, parsing and the batched reward call."""
    import anyio

    service.check_auth(request.headers.get("authorization"))
    batcher = service.batcher(name)
    service.check_content_type(request.headers)
    n = service.body_length(request.headers)
    limits, phase, body_deadline = service.limits, "reading the body", None
    try:
        with anyio.fail_after(limits.timeout_s) as deadline:
            async with service.bodies.account() as account:
                with anyio.fail_after(limits.body_timeout_s) as body_deadline:
                    body = await _read_body(request, n, account)
                phase = "waiting for a free slot"
                async with service.slots:
                    phase = "scoring"
                    parsed = await anyio.to_thread.run_sync(
                        parse_score_request,
                        body,
                        limits.max_pixels,
                        limits.max_json_values,
                        limits.max_text_bytes,
                    )
                    del body
                    client = request.client
                    return await batcher.score(parsed, None if client is None else (client.host, client.port))
    except TimeoutError:
        if body_deadline is not None and body_deadline.cancel_called and phase == "reading the body":
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
