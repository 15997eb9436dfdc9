"""Dynamic batching for the reward server: concurrent requests merged into one reward call.

Each served reward has one :class:`Batcher`, whose worker task makes one reward call at a time (a GPU
model is never entered twice at once). The worker waits until enough images of one size are queued
or ``max_wait_s`` has passed (see :meth:`Batcher._collect`), then takes up to ``max_batch`` images,
splitting a request across calls when it does not fit, decodes their PNGs (only this batch's pixels
are ever in memory), calls the reward in a thread and hands each caller its own scores. Requests with
images of another size wait for a later call. When a merged call fails, it is halved until the failing
request is alone, so one caller's bad input (a 422) or a reward bug it triggers does not fail its
neighbours. A request found failing alone marks its inputs (prompt and metadata) and its connection
as suspect for ``SUSPECT_S``: a later request that shares either goes alone, so a client sending the
same bad input again, even on new connections, does not fail merged calls; a success clears them.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from flowcredit.rewards import RewardInputError, RewardOutputError
from flowcredit.rewards.wire import ScoreRequest, ServeError, decode_pngs


@dataclass
class _Pending:
    """One request in the queue: its images, the scores filled in so far and the caller's future."""

    request: ScoreRequest
    future: asyncio.Future
    scores: list = field(default_factory=list)
    left: int = 0  # images not scored yet
    served: int = -1  # the last reward call that took some of its images (-1: none yet)
    source: object = None  # the caller's connection (host, port), if known
    keys: tuple = ()  # its connection and inputs, as suspect marks name them (:func:`_keys`)


@dataclass
class _Slice:
    """Images ``start:stop`` of one pending request, queued at ``since`` (event-loop time)."""

    pending: _Pending
    start: int
    stop: int
    since: float


def _to_scores(value, n: int) -> list[float | None]:
    """A reward's output → ``n`` floats (None for a non-finite score); :class:`RewardOutputError` else."""
    try:
        value = torch.as_tensor(value, dtype=torch.float32).reshape(-1).cpu()
    except (TypeError, ValueError, RuntimeError):
        raise RewardOutputError(f"reward returned {type(value).__name__}, not numbers") from None
    if value.shape[0] != n:
        raise RewardOutputError(f"reward returned {value.shape[0]} values for {n} images")
    return [v if math.isfinite(v) else None for v in value.tolist()]


def _in_request(exc: RewardInputError, batch: list[_Slice]) -> RewardInputError:
    """``exc``, raised for a position in a reward call of ``batch``'s slices, for that sample's position
    in its own request (a call merges requests and may start inside one)."""
    offset = 0
    for s in batch:
        if offset <= exc.index < offset + s.stop - s.start:
            return exc.at(s.start + exc.index - offset)
        offset += s.stop - s.start
    return exc


SUSPECT_S = 60.0
"""Seconds for which the inputs and connection of a request that failed alone make requests go alone."""
MAX_SUSPECTS = 10_000  # marks kept at most (the oldest are forgotten first)


def _keys(request: ScoreRequest, source: object) -> tuple:
    """What suspect marks name: the connection, and each distinct (prompt, metadata) of the request."""
    inputs = {
        hash((p, json.dumps(m, sort_keys=True, default=repr)))
        for p, m in zip(request.prompts, request.metadata)
    }
    return (("connection", source),) * (source is not None) + tuple(("input", h) for h in inputs)


class RewardAborted(RuntimeError):
    """A reward raised ``SystemExit`` or ``KeyboardInterrupt`` (``kind``): a 500, the server goes on."""

    def __init__(self, kind: str):
        super().__init__(f"the reward raised {kind}")
        self.kind = kind


class Batcher:
    """Merges concurrent :meth:`score` calls into calls of ``reward_fn(images, prompts, metadata)``.

    Args:
        reward_fn: ``(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)``.
        max_batch: most images per reward call. max_wait_s: longest an image waits for company.
    """

    def __init__(self, reward_fn: Callable, max_batch: int, max_wait_s: float):
        self.reward_fn, self.max_batch, self.max_wait_s = reward_fn, max_batch, max_wait_s
        self.calls = 0  # reward calls made, for /health and tests
        self._last_batch = 0  # images in the last call
        self._taken = 0  # batches taken so far (orders requests by when they were last served)
        self._suspects: dict[object, float] = {}  # connection or input → until when its requests go alone
        self._queue: deque[_Slice] = deque()
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task | None = None
        # one thread makes every call: the reward is never entered twice at once, and its memory is
        # reused from one call to the next (a pool would hold a few calls' worth, one per thread)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="reward")

    def start(self) -> None:
        """Start the worker task (in the running event loop)."""
        self._worker = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def score(self, request: ScoreRequest, source: object = None) -> list[float | None]:
        """Scores of the request's images; raises what the reward (or decoding) raised for them."""
        n = len(request.prompts)
        if n == 0:
            return []
        loop = asyncio.get_running_loop()
        pending = _Pending(
            request, loop.create_future(), [None] * n, n, source=source, keys=_keys(request, source)
        )
        now = loop.time()
        self._queue.extend(
            _Slice(pending, i, min(i + self.max_batch, n), now) for i in range(0, n, self.max_batch)
        )
        self._arrived.set()
        return await pending.future  # cancelled with the request: its queued slices are then skipped

    def _drop_abandoned(self) -> None:
        self._queue = deque(s for s in self._queue if not s.pending.future.done())

    async def _collect(self) -> list[_Slice]:
        """Wait for work, then take up to ``max_batch`` images of the oldest request's size.

        The wait ends when ``max_batch`` images are queued, or as many as the last call took (steady
        clients that came back together go at once), or ``max_wait_s`` after the oldest image arrived
        or the reward became free, whichever is later (clients that came back apart, some while the
        reward was busy, are brought together again instead of taking turns).
        """
        loop = asyncio.get_running_loop()
        free_since = loop.time()
        while True:
            self._drop_abandoned()
            if self._queue:
                break
            self._arrived.clear()
            await self._arrived.wait()
        self._fair_order()
        size = self._queue[0].pending.request.size
        deadline = max(self._queue[0].since, free_since) + self.max_wait_s
        enough = min(self.max_batch, self._last_batch or self.max_batch)
        while sum(s.stop - s.start for s in self._queue if s.pending.request.size == size) < enough:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        return self._take(size)

    def _fair_order(self) -> None:
        """Requests not served yet first (in arrival order), then those served longest ago: a large
        request split over many calls takes turns with the requests that arrive behind it, so a
        small one waits at most about one call, not the whole large one."""
        self._queue = deque(sorted(self._queue, key=lambda s: s.pending.served))

    def _suspect(self, pending: _Pending) -> bool:
        """Whether the request's connection or one of its inputs failed alone lately."""
        now, found = asyncio.get_running_loop().time(), False
        for key in pending.keys:
            until = self._suspects.get(key)
            if until is not None and until < now:
                del self._suspects[key]
            found = found or (until is not None and until >= now)
        return found

    def _mark(self, pending: _Pending, failed: bool) -> None:
        """After a request failed alone, mark its keys; after one succeeded, clear them."""
        until = asyncio.get_running_loop().time() + SUSPECT_S
        for key in pending.keys:
            self._suspects.pop(key, None)
            if failed:
                self._suspects[key] = until  # re-inserted: the dict stays in order of marking
        while len(self._suspects) > MAX_SUSPECTS:
            del self._suspects[next(iter(self._suspects))]

    def _take(self, size) -> list[_Slice]:
        """Up to ``max_batch`` queued images of ``size``. A suspect request (its connection or one of
        its inputs failed alone lately) goes alone, so one failing client does not make every merged
        call fail and be halved; the others are not merged with it."""
        batch, room, rest = [], self.max_batch, deque()
        alone = None  # the suspect request this call scores on its own
        for s in self._queue:
            take = room > 0 and s.pending.request.size == size and not s.pending.future.done()
            if take and batch:
                take = alone is s.pending if alone is not None else not self._suspect(s.pending)
            if not take:
                rest.append(s)
                continue
            if not batch and self._suspect(s.pending):
                alone = s.pending
            stop = min(s.stop, s.start + room)
            batch.append(_Slice(s.pending, s.start, stop, s.since))
            if stop < s.stop:  # the rest of a split request goes first next time
                rest.appendleft(_Slice(s.pending, stop, s.stop, s.since))
            room -= stop - s.start
        self._queue = rest
        self._last_batch = self.max_batch - room
        self._taken += 1
        for s in batch:
            s.pending.served = self._taken
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            if batch:
                await self._score_batch(batch)

    async def _score_batch(self, batch: list[_Slice]) -> None:
        batch = [s for s in batch if not s.pending.future.done()]  # abandoned, or failed to decode
        if not batch:
            return
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._thread, self._call, batch)
        except Exception as exc:
            requests = list(dict.fromkeys(id(s.pending) for s in batch))  # in arrival order
            if len(requests) == 1:  # found alone: requests sharing its connection or inputs go alone
                self._mark(batch[0].pending, failed=True)
                return self._fail(batch[0].pending, exc)
            # find whose input failed by halving: one bad request among n costs O(log n) extra calls
            half = set(requests[: len(requests) // 2])
            await self._score_batch([s for s in batch if id(s.pending) in half])
            await self._score_batch([s for s in batch if id(s.pending) not in half])
            return
        for s, scores in results:
            s.pending.scores[s.start : s.stop] = scores
            s.pending.left -= s.stop - s.start
            if s.pending.left == 0 and not s.pending.future.done():
                self._mark(s.pending, failed=False)
                s.pending.future.set_result(s.pending.scores)

    def _call(self, batch: list[_Slice]) -> list[tuple[_Slice, list[float | None]]]:
        """In a worker thread: decode the batch's PNGs, call the reward once, split the scores."""
        good, pixels = [], []
        for s in batch:  # a corrupt image fails its own request only
            try:
                pixels.append(decode_pngs(s.pending.request.pngs[s.start : s.stop], first=s.start))
                good.append(s)
            except ServeError as exc:
                s.pending.future.get_loop().call_soon_threadsafe(self._fail, s.pending, exc)
        if not good:
            return []
        prompts = [p for s in good for p in s.pending.request.prompts[s.start : s.stop]]
        metadata = [m for s in good for m in s.pending.request.metadata[s.start : s.stop]]
        self.calls += 1
        images = torch.from_numpy(np.concatenate(pixels)).permute(0, 3, 1, 2).float().div_(255.0)
        del pixels
        try:
            raw = self.reward_fn(images, prompts, metadata)
        except RewardInputError as exc:
            raise _in_request(exc, good) from exc
        except Exception:
            raise
        except (
            BaseException
        ) as exc:  # SystemExit / KeyboardInterrupt inside a reward must not stop the server
            raise RewardAborted(type(exc).__name__) from exc
        scores = _to_scores(raw, len(prompts))
        out, i = [], 0
        for s in good:
            out.append((s, scores[i : i + s.stop - s.start]))
            i += s.stop - s.start
        return out

    @staticmethod
    def _fail(pending: _Pending, exc: BaseException) -> None:
        if not pending.future.done():
            pending.future.set_exception(exc)
