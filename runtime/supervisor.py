"""The driver's supervisor: every wait of the RL loop goes through it, so no wait is unbounded.

While the loop waits on a result (`get`) or on the rollout queue (`next_message`), the supervisor, every `poll_s`:

- looks at every actor it watches: each has one cheap call outstanding (a ping); a ping that comes back with an
  error means the actor died (a killed engine, trainer rank, queue or lock). A watched long-running call (the
  generator's `run`) that fails means its actor died or raised (a bad data row, every runner gone);
- ends the phase as stalled when it has waited `stall_timeout_s`;
- after SIGINT/SIGTERM, gives the current phase `stop_timeout_s`, then gives up on it (`RunStopped`).

A death or a stall raises `RunAborted`, which names the actor, the phase and the recipe key most likely at fault; the
loop adds its prompt accounting and tears everything down within a bound.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.queue import Empty

from runtime.books import Books
from schemas.plan import SupervisorPlan

PING_EVERY_S = 2.0  # a fresh ping per actor this often (an outstanding one that errors is noticed at the next poll)
DEATH_GRACE_S = 3.0
"""After an actor's error, how long to look for a watched actor that died: a dead rank's peers fail on the broken
collective before Ray has told the driver of the death, and the one that died is the culprit."""
COLLECTIVE_GRACE_S = 15.0
"""The same look after an error that says a collective broke (a peer's process is gone): Ray can take longer than
DEATH_GRACE_S to report a death on a loaded machine, and without it the peer's error would be blamed on a recipe key."""
BROKEN_COLLECTIVE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
                     "remote process exited", "Socket Timeout")
"""Texts of gloo's and NCCL's errors when a peer rank's process died."""


class RunAborted(Exception):
    """An actor died or a phase stalled. `str()` is one line (the CLI prints the last line of an error)."""

    def __init__(self, actor: str, phase: str, key: str, what: str):
        self.actor, self.phase, self.key, self.what = actor, phase, key, what
        self.accounting: dict[str, int] = {}
        super().__init__(self.describe())

    def describe(self) -> str:
        line = f"{self.actor} {self.what} during {self.phase!r} (likely recipe key: {self.key})"
        if self.accounting:
            line += f"; {accounting_line(self.accounting)}"
        return line

    def with_accounting(self, accounting: dict[str, int]) -> RunAborted:
        self.accounting = dict(accounting)
        self.args = (self.describe(),)
        return self


class RunStopped(Exception):
    """A stop signal came and the current phase did not finish within `stop_timeout_s`."""


def accounting_line(acc: dict[str, int]) -> str:
    dropped = {k.removeprefix("prompts/dropped/"): v for k, v in acc.items() if k.startswith("prompts/dropped/")}
    return (f"prompts consumed {acc.get('prompts/consumed', 0)} (trained {acc.get('prompts/trained', 0)}, "
            f"dropped {sum(dropped.values())}: {dropped})")


class StopFlag:
    """SIGINT/SIGTERM ask the loop to stop after the current phase; a second signal interrupts at once. SIGUSR1
    (Slurm's time-limit warning, `launch.slurm.requeue`) asks it to checkpoint after the current step and stop."""

    def __init__(self):
        self.requested = self.requeue = False
        self.at = 0.0
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}

    def _handle(self, signum, frame):
        if signum == signal.SIGUSR1:
            self.requested = self.requeue = True
            self.at = time.monotonic()
            print("\nSIGUSR1: checkpointing after the current step, then exiting for a requeue", flush=True)
            return
        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.at = True, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: stopping after the current phase (send again to abort)", flush=True)

    def restore(self):
        for s, h in self._previous.items():
            signal.signal(s, h)


@dataclass
class _Watched:
    name: str
    key: str
    ping: Callable[[], object] | None   # None: `ref` is a long-running call, not re-issued
    ref: Any
    sent_at: float
    actor_id: str | None = None         # hex id of the actor (names it when a call to it fails)


class Supervisor:
    def __init__(self, bounds: SupervisorPlan, stop: StopFlag):
        self.bounds, self.stop = bounds, stop
        self.watched: list[_Watched] = []
        self.phase_name, self.actor, self.key = "start-up", "the cluster", "cluster"
        self.ray_checked_at = 0.0

    # ------------------------------------------------------------------------------------------------ watching
    def watch(self, name: str, handle, ping: Callable[[], object], key: str) -> None:
        """Watch the actor `handle` through `ping()`, a cheap call to it (e.g. `handle.ready.remote`)."""
        self.watched.append(_Watched(name, key, ping, ping(), time.monotonic(), _actor_id(handle)))

    def watch_call(self, name: str, handle, ref, key: str) -> None:
        """Watch a long-running call: its failure (the actor died or raised) ends the run."""
        self.watched.append(_Watched(name, key, None, ref, time.monotonic(), _actor_id(handle)))

    def unwatch(self, name: str) -> None:
        self.watched = [w for w in self.watched if w.name != name]

    @contextmanager
    def phase(self, name: str, actor: str, key: str, timings: dict[str, float] | None = None) -> Iterator[None]:
        """What the loop is waiting on (`actor`, the recipe `key` most likely at fault), for the errors it raises.
        With `timings`, the phase's wall time is added to `timings["timing/<name>"]` (the name is the metric's)."""
        previous = self.phase_name, self.actor, self.key
        self.phase_name, self.actor, self.key = name, actor, key
        start = time.time()
        try:
            yield
        finally:
            self.phase_name, self.actor, self.key = previous
            if timings is not None:
                timings[f"timing/{name}"] = timings.get(f"timing/{name}", 0.0) + time.time() - start

    def check(self) -> None:
        """Raise `RunAborted` when a watched actor has died or its watched call failed."""
        pending = [w.ref for w in self.watched]
        if not pending:
            return
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        ready_ids = {id(r) for r in ready}
        now = time.monotonic()
        for w in self.watched:
            if id(w.ref) not in ready_ids:
                continue
            try:
                ray.get(w.ref, timeout=0)
            except ray.exceptions.RayActorError as exc:  # also an error of its constructor
                _raise_if_ray_is_down(self.phase_name, _last_line(exc))
                raise RunAborted(w.name, self.phase_name, _key_of(str(exc), w.key),
                                 f"died ({_last_line(exc)})") from None
            except Exception as exc:  # the actor's own error, with its remote traceback in the text
                cause = getattr(exc, "cause", None) or exc
                raise RunAborted(w.name, self.phase_name, _key_of(f"{type(cause).__name__}: {cause}", w.key),
                                 f"failed: {type(cause).__name__}: {_last_line(cause)}") from None
            if w.ping is None:
                self.watched.remove(w)  # finished normally: nothing left to watch
                return
            if now - w.sent_at >= PING_EVERY_S:
                w.ref, w.sent_at = w.ping(), now

    # ------------------------------------------------------------------------------------------------ waiting
    def get(self, refs, *, timeout: float | None = None):
        """`ray.get` in slices of `poll_s`, checking deaths, the stall bound and the stop bound between slices."""
        single = not isinstance(refs, list)
        pending = [refs] if single else list(refs)
        bound = self.bounds.stall_timeout_s if timeout is None else timeout
        start = time.monotonic()
        while True:
            ready, _ = ray.wait(pending, num_returns=len(pending), timeout=self.bounds.poll_s)
            if len(ready) == len(pending):
                break
            self._between_slices(start, bound)
        try:
            values = ray.get(pending, timeout=self.bounds.poll_s)
        except ray.exceptions.RayError as exc:
            _raise_if_ray_is_down(self.phase_name, _last_line(exc))
            self._name_the_failure(exc, pending)
            raise
        return values[0] if single else values

    def _name_the_failure(self, exc: BaseException, pending: list) -> None:
        """Raise `RunAborted` for an error of `ray.get(pending)`: the actor that died first, else the one that
        raised."""
        if isinstance(exc, ray.exceptions.RayActorError):
            dead = self._watched_of(exc) or self._first_dead(pending)
            actor, key = (dead.name, dead.key) if dead is not None else (self.actor, self.key)
            raise RunAborted(actor, self.phase_name, _key_of(str(exc), key), f"died ({_last_line(exc)})") from None
        if isinstance(exc, ray.exceptions.RayTaskError):  # the actor raised: its error, remote traceback in the text
            cause = getattr(exc, "cause", None) or exc
            failed = f"{type(cause).__name__}: {_last_line(cause)}"
            collective = broken_collective(f"{type(cause).__name__}: {cause}")
            dead = self._first_dead(pending, COLLECTIVE_GRACE_S if collective else DEATH_GRACE_S)
            if dead is not None:  # it raised because a peer died (a collective broke): the peer is the culprit
                raise RunAborted(dead.name, self.phase_name, dead.key,
                                 f"died (then {self.actor} failed: {failed})") from None
            if collective:  # a peer died and Ray has not said which: no recipe key is to blame
                raise RunAborted(self.actor, self.phase_name, "none (a peer rank's process died: killed or out of "
                                 "memory; the Ray logs name it)", f"lost a peer of its collective ({failed})") from None
            raise RunAborted(self.actor, self.phase_name, _key_of(f"{type(cause).__name__}: {cause}", self.key),
                             f"failed: {failed}") from None

    def _watched_of(self, exc: BaseException) -> _Watched | None:
        """The watched actor a `RayActorError` is about, if it is one."""
        failed = getattr(exc, "actor_id", None)
        failed = failed.hex() if failed is not None and hasattr(failed, "hex") and not isinstance(failed, str) else failed
        return next((w for w in self.watched if w.actor_id and w.actor_id == failed), None) if failed else None

    def _first_dead(self, refs: list, grace_s: float = DEATH_GRACE_S) -> _Watched | None:
        """A watched actor that died, found within `grace_s`: from `refs` that failed with `RayActorError`,
        or from a fresh ping of each watched actor."""
        pings = [(w, w.ping()) for w in self.watched if w.ping is not None]
        deadline = time.monotonic() + grace_s
        while True:
            for ref in [*refs, *(p for _, p in pings)]:
                if not ray.wait([ref], timeout=0)[0]:
                    continue
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as exc:
                    dead = self._watched_of(exc) or next((w for w, p in pings if p is ref), None)
                    if dead is not None:
                        return dead
                except Exception:  # noqa: S112 - an error of a live actor: not a death
                    continue
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)

    def wait_unless_stopped(self, ref) -> bool:
        """Wait for `ref` as `get` does (its result discarded, its error raised), or return False as soon as a stop is
        requested: for a wait the stop makes pointless, which could otherwise outlast the stop bound (the engine
        lock, held by the generator until its batch is done, however long its agents take)."""
        start = time.monotonic()
        while not self.stop.requested:
            if ray.wait([ref], timeout=self.bounds.poll_s)[0]:
                self.get(ref)
                return True
            self._between_slices(start, self.bounds.stall_timeout_s)
        return False

    def next_message(self, queue):
        """The next message of the rollout queue, or None when a stop was requested."""
        start = time.monotonic()
        while not self.stop.requested:
            try:
                return queue.get(timeout=self.bounds.poll_s)
            except Empty:
                self._between_slices(start, self.bounds.stall_timeout_s)
        return None

    def _between_slices(self, start: float, bound: float) -> None:
        self.check()
        now = time.monotonic()
        if now - self.ray_checked_at >= PING_EVERY_S:  # a dead GCS or raylet answers no ping, raises nothing
            self.ray_checked_at = now
            _raise_if_ray_is_down(self.phase_name, f"waiting {now - start:.0f} s")
        if self.stop.requested and now - self.stop.at > self.bounds.stop_timeout_s:
            raise RunStopped(f"the phase {self.phase_name!r} did not finish within {self.bounds.stop_timeout_s:g} s "
                             "of the stop signal")
        if now - start > bound:
            _raise_if_ray_is_down(self.phase_name, f"no result for {now - start:.0f} s")
            raise RunAborted(self.actor, self.phase_name, f"{self.key} (bound: train.stall_timeout_s)",
                             f"stalled: no result for {now - start:.0f} s")


def ray_component_down() -> str | None:
    """Ray itself, when one of its components this driver depends on no longer accepts connections: "the Ray GCS
    (head node, ADDRESS)" or "the raylet of this node (ADDRESS)"; None when both answer (or Ray is not started)."""
    try:
        node = ray._private.worker.global_worker.node
        gcs_host, _, gcs_port = node.gcs_address.rpartition(":")
        parts = [("the Ray GCS (head node, {})", gcs_host, int(gcs_port)),
                 ("the raylet of this node ({})", node.node_ip_address, int(node.node_manager_port))]
    except Exception:  # noqa: BLE001 - not connected: nothing to name
        return None
    for name, host, port in parts:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
        except OSError:
            return name.format(f"{host}:{port}")
    return None


def _raise_if_ray_is_down(phase: str, seen: str) -> None:
    """A death, error or stall that Ray itself caused is Ray's, not the actor's that happened to be waited on."""
    down = ray_component_down()
    if down is not None:
        raise RunAborted(down, phase, "the Ray cluster (no recipe key: see the Ray logs)",
                         f"is down (what the driver saw: {seen})") from None


def _actor_id(handle) -> str | None:
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else None


_TRAILERS = ("For further information visit ",)
"""Last lines of an error that say nothing of what happened (pydantic's validation errors end with one)."""


def _last_line(exc: BaseException) -> str:
    """The line that says what happened (a remote traceback's last), cut to its first sentence when long (Ray's
    death notices run on for a paragraph of possible causes)."""
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    while len(lines) > 1 and lines[-1].strip().startswith(_TRAILERS):  # a pydantic error's last line is a link
        lines.pop()
    line = lines[-1].strip() if lines else type(exc).__name__
    return line.split(". ")[0] + "." if len(line) > 160 and ". " in line else line


def broken_collective(text: str) -> bool:
    """Whether an actor's error says a collective lost a peer (`BROKEN_COLLECTIVE`)."""
    return any(marker in text for marker in BROKEN_COLLECTIVE)


def _key_of(text: str, default: str) -> str:
    """The recipe key an actor's error (its text, remote traceback included) most likely comes from."""
    if "DataError" in text:
        return "data.prompts"
    if "AgentLoadError" in text:
        return "agent.path"
    return default


class Started:
    """What the RL loop started, so that every exit path (finished, stopped, aborted, interrupted) tears it down within
    a bound: a graceful trainer shutdown first, then every actor is killed and the placement groups removed."""

    def __init__(self):
        self.handles: list = []
        self.queues: list = []
        self.pgs: list = []
        self.files: list = []
        self.groups: list = []  # the FSDP groups (policy, critic, separate reference): shut down gracefully first
        self.generator = None
        self.sink = None
        self.books: Books | None = None

    def generator_accounting(self, timeout: float) -> dict[str, int]:
        """The generator's accounting after cancelling it; when it cannot answer, what this loop saw."""
        if self.generator is not None:
            try:
                return ray.get(self.generator.stop.remote(), timeout=timeout)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                pass
        return self.books.last_accounting() if self.books is not None else {}

    def teardown(self, timeout: float) -> None:
        if self.sink is not None:
            self.sink.close()
        for f in self.files:
            f.close()
        ranks = [w for group in self.groups for w in group.workers]
        try:
            ray.get([w.shutdown.remote() for w in ranks], timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass
        for handle in [*ranks, *self.handles]:
            try:
                ray.kill(handle)
            except (ray.exceptions.RayError, ValueError):
                pass
        for q in self.queues:
            try:
                q.shutdown()
            except ray.exceptions.RayError:
                pass
        for pg in self.pgs:
            ray.util.remove_placement_group(pg)
