"""What bounds an agent's reach into its runner: its `Env` runs where a blocking call can be abandoned
(`EnvThread`), and what it hands back is cut to what a rollout can hold before anything costly is done with it
(`tokenize_within`, `bounded_info`, `TooManyImages`). Issue 32: a 10 MB observation tokenized whole grew runners by
gigabytes; a `time.sleep` in `Env.step` defeated every asyncio timeout of the runner."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import numbers
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.agents.base import Tokenizer

logger = logging.getLogger(__name__)

# Tokenizing is CPU work that must not run on the event loop (a group's n rollouts share one loop) and must not share
# asyncio's default executor with agent code: an agent that parks blocking work there can starve the tokenizer the
# chat server awaits, and the whole actor deadlocks. Per-turn and small, so a small dedicated pool is enough.
_TOKENIZE_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tokenize")

# An observation is tokenized only as far as it can fit: first this many characters per token of room, doubled until
# the room is filled or the text ends (a 10 MB tool output tokenized whole grew runners by gigabytes).
_CHARS_PER_TOKEN_GUESS = 4

# `Result.info` kept per rollout: numbers (they become metrics) and short strings; the rest is dropped and counted.
_MAX_INFO_ITEMS = 64
_MAX_INFO_STR_CHARS = 1024


class TooManyImages(ValueError):
    """A step returned more images than the episode may hold (its rollout is dropped as `too_many_images`)."""


async def tokenize(tokenizer: Tokenizer, text: str) -> list[int]:
    if not text:
        return []
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_TOKENIZE_EXECUTOR, lambda: list(tokenizer.encode(text, add_special_tokens=False)))


async def tokenize_within(tokenizer: Tokenizer, text: str, room: int) -> tuple[str, list[int], bool]:
    """(text, ids, cut): at most `room` tokens of `text`, tokenizing only a prefix of it (a few characters per
    token of room, doubled while it yields fewer tokens than the room and text remains): a huge observation costs
    what fits, not its size. `cut`: something was left out (the text returned is then the kept tokens, decoded)."""
    if room <= 0:
        return "", [], bool(text)
    chars = room * _CHARS_PER_TOKEN_GUESS
    while True:
        ids = await tokenize(tokenizer, text[:chars])
        if chars >= len(text) and len(ids) <= room:
            return text, ids, False
        if len(ids) > room or chars >= len(text):
            ids = ids[:room]
            return tokenizer.decode(ids, skip_special_tokens=False), ids, True
        chars *= 2


def bounded_info(info: dict | None) -> tuple[dict, int]:
    """(kept, dropped): `Result.info` without what a runner should not hold per rollout: entries past
    `_MAX_INFO_ITEMS`, and values that are neither numbers nor strings of at most `_MAX_INFO_STR_CHARS`."""
    kept, dropped = {}, 0
    for k, v in (info or {}).items():
        small = isinstance(v, (numbers.Real, type(None))) or (isinstance(v, str) and len(v) <= _MAX_INFO_STR_CHARS)
        if small and len(kept) < _MAX_INFO_ITEMS:
            kept[k] = v
        else:
            dropped += 1
    return kept, dropped


class EnvThread:
    """One episode's `Env` lives on its own thread and event loop. A call that blocks (`time.sleep`, a synchronous
    HTTP call) then stalls only that thread: the runner's loop keeps running its timeouts, gives the call up at its
    bound and goes on; the stuck thread is abandoned (a daemon: it ends once the call returns, or with the process).
    """

    abandoned = 0  # threads given up on in this process (a call of theirs did not return within its bound)

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.busy = 0  # calls submitted and not finished on the env's loop (both threads count: under the lock)
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="env", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    async def call(self, fn, *args, timeout: float | None = None):
        """`await fn(*args)` on the env's loop, bounded by `timeout` (None: unbounded) and by the caller's own
        cancellation (the episode timeout); on either, the call is cancelled there and abandoned here."""
        with self._lock:
            self.busy += 1
        fut = asyncio.run_coroutine_threadsafe(self._run(fn, *args), self.loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except BaseException:
            fut.cancel()
            raise

    async def _run(self, fn, *args):
        try:
            return await fn(*args)
        finally:  # also when cancelled: a call stuck in blocking code gets here only once that code returns
            with self._lock:
                self.busy -= 1

    async def finish(self, close, timeout: float | None) -> None:
        """Run `close` (the env's, or None) and end the thread. When an earlier call is still stuck, nothing is
        awaited: the close is queued behind it and the thread abandoned, so a blocked env costs no more time."""
        for _ in range(20):  # a cancelled await ends at once; blocking code does not
            if not self.busy:
                break
            await asyncio.sleep(0.005)
        if self.busy:
            EnvThread.abandoned += 1
            logger.warning("an Env call is still running past its bound; its thread is abandoned (%d so far in "
                           "this runner)", EnvThread.abandoned)
            asyncio.run_coroutine_threadsafe(_close_then_stop(close), self.loop)
            return
        try:
            if close is not None:
                await self.call(close, timeout=timeout)
        except Exception:
            logger.warning("Env.close() failed; its resources may leak", exc_info=True)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)


async def _close_then_stop(close) -> None:
    try:
        if close is not None:
            await close()
    except Exception:
        logger.warning("Env.close() failed; its resources may leak", exc_info=True)
    finally:
        asyncio.get_running_loop().stop()
