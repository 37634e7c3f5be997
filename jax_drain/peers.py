"""Ends a multi-process run soon after one of its processes dies, naming it, with what to do.

A process whose peer died waits in its next collective: Gloo (CPUs) gives collectives no
timeout, and XLA gives NCCL's none by default. Left alone, only JAX's coordination service ends
it, ``heartbeat_timeout_seconds`` (100 s by default) after the death, by aborting the process with
a C++ stack. :func:`watch_peers` is jax_drain's own check, the same on every transport: each
process publishes a beat in the coordination service's key-value store and reads everyone's, in
a thread (a process waiting in a collective waits in C++, without the GIL). When a process's
beat stops for ``timeout_seconds``, or it publishes that it failed, every other process prints
one line naming it and saying what to do, and exits with :data:`PEER_FAILURE_EXIT`.

Example::

    jax.distributed.initialize()
    with jd.watch_peers(timeout_seconds=60):
        for batch in batches:
            state, metrics = step(state, batch)
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping

import jax

from jax_drain import _compat

PEER_FAILURE_EXIT = 4
"""Exit status of a process that :func:`watch_peers` ended because another process died."""

_PREFIX = "jax_drain/peers/"
_FINISHED = "finished"
_FAILED = "failed: "


@dataclasses.dataclass
class PeerTracker:
    """Decides, from what each process last published, which processes are gone.

    Bookkeeping only, over the values read from the key-value store (``{process: value}``) and
    a clock the caller gives, so the decision is testable without processes or threads. A value is a
    beat (it changes while the process lives), ``"finished"``, or ``"failed: <why>"``.
    """

    me: int
    count: int
    timeout_seconds: float
    started: float
    _seen: dict[int, tuple[str, float]] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def observe(self, values: Mapping[int, str], now: float) -> list[str]:
        """What is wrong with the other processes at time ``now``: one phrase per gone process,
        empty while every one of them beats, has finished, or is within its timeout."""
        gone = []
        for process in range(self.count):
            if process == self.me:
                continue
            value = values.get(process)
            if value is None:
                if now - self.started > self.timeout_seconds:
                    gone.append(f"process {process} of {self.count} has published nothing for "
                                f"{now - self.started:.0f} s: it died before its watch began, or does "
                                "not call jax_drain.watch_peers (every process must, after "
                                "jax.distributed.initialize)")
                continue
            if value.startswith(_FAILED):
                gone.append(f"process {process} of {self.count} failed with {value[len(_FAILED):]}")
                continue
            if value == _FINISHED:
                continue
            last = self._seen.get(process)
            if last is None or last[0] != value:
                self._seen[process] = (value, now)
            elif now - last[1] > self.timeout_seconds:
                gone.append(f"process {process} of {self.count} stopped answering: no sign of life for "
                            f"{now - last[1]:.0f} s (it was killed, ran out of memory, or its host or "
                            "network is down)")
        return gone


class PeerWatch:
    """A running :func:`watch_peers`. As a context manager it publishes how the block ended:
    an exception ends the other processes at once, naming it; a normal end is ``"finished"``,
    which the others never report. :meth:`stop` is the normal end outside a ``with`` block; a
    watch never stopped publishes at interpreter exit (a failure if the program ends on an
    uncaught exception). A process that published a failure and ends on it exits with status 1
    after its traceback, without JAX's shutdown, which would wait for the processes it ended."""

    def __init__(self, client: Any, *, me: int, count: int, timeout_seconds: float,
                 poll_seconds: float, exit_code: int, end: Callable[[str, int], None]):
        self._client, self._me, self._count = client, me, count
        self._poll, self._exit_code, self._end = poll_seconds, exit_code, end
        self._tracker = PeerTracker(me, count, timeout_seconds, time.monotonic())
        self._stopped = threading.Event()
        self._publish_lock = threading.Lock()
        self._failed: BaseException | None = None
        self._own_error: BaseException | None = None  # this process's error, while it may be a peer's doing
        self._publish("0")
        self._thread = threading.Thread(target=self._run, name="jax_drain.watch_peers", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @property
    def timeout_seconds(self) -> float:
        return self._tracker.timeout_seconds

    def stop(self, failure: BaseException | None = None) -> None:
        """Ends the watch and tells the others this process is done; ``failure`` (why it failed)
        ends them at once. Idempotent: the first call's outcome is the one published.

        A failure that a dead peer can cause (a collective's or the coordination service's error,
        a timeout) is published only once no peer is found gone within the timeout: where one
        is, this process ends naming it instead, so that the survivors do not blame each other.
        """
        if self._stopped.is_set():
            return
        if failure is not None and self._count > 1 and _may_come_from_a_peer(failure):
            self._own_error = failure
            self._thread.join(self._tracker.timeout_seconds + 2 * self._poll)  # ends the process if a peer is gone
        self._stopped.set()
        self._failed = failure
        if failure is None:
            atexit.unregister(self._at_exit)  # kept after a failure: see _at_exit
        self._publish(_FINISHED if failure is None else _FAILED + _describe(failure), final=True)
        self._thread.join()

    def __enter__(self) -> PeerWatch:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.stop(exc)

    def _at_exit(self) -> None:
        # Runs before jax's own exit handler (registered at import, earlier), whose
        # jax.distributed.shutdown waits for every process: a process that failed has told the
        # others to end, and would wait for them there without end.
        uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        self.stop(uncaught)
        if self._failed is not None and uncaught is not None and self._count > 1:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _publish(self, value: str, *, final: bool = False) -> None:
        with self._publish_lock:
            if self._stopped.is_set() and not final:
                return
            try:
                self._client.key_value_set(f"{_PREFIX}{self._me}", value, allow_overwrite=True)
            except Exception:
                if not final:
                    raise
                # The service is gone (process 0 died): the others are ending already, and
                # raising here would hide the error the caller is handling.

    def _run(self) -> None:
        beat = 0
        while not self._stopped.wait(self._poll):
            beat += 1
            try:
                self._publish(str(beat))
                entries = self._client.key_value_dir_get(_PREFIX)
            except Exception as e:  # the coordination service itself is gone
                if not self._stopped.is_set():
                    self._give_up([f"the coordination service (process 0) stopped answering ({_describe(e)}): "
                                   "process 0 died, or the network to it is down"])
                return
            gone = self._tracker.observe(_by_process(entries), time.monotonic())
            if gone and not self._stopped.is_set():
                self._give_up(gone)
                return

    def _give_up(self, gone: list[str]) -> None:
        own = "" if self._own_error is None else f" (its own error, from that: {_describe(self._own_error)})"
        self._end(f"jax_drain.watch_peers: {'; '.join(gone)}. Process {self._me}{own} ends now (exit status "
                  f"{self._exit_code}): its collectives would wait for the missing process without end. "
                  "Restart every process; jax_drain.restore_checkpoint restores the newest complete step.",
                  self._exit_code)


def watch_peers(*, timeout_seconds: float = 60.0, poll_seconds: float | None = None,
                exit_code: int = PEER_FAILURE_EXIT) -> PeerWatch:
    """Ends this process, naming the peer and what to do, when another process of the run dies.

    Call it on every process, right after ``jax.distributed.initialize``. A process that stops
    publishing for ``timeout_seconds`` (killed, out of memory, host down), or that ends on an
    exception inside ``with jd.watch_peers():``, makes every other process print one line on
    stderr and exit with ``exit_code``: a survivor is otherwise stuck in a collective that never
    ends. Bound: a death is reported within ``timeout_seconds + 2 * poll_seconds`` (plus one
    round trip to the coordination service); a failure inside the ``with`` block within
    ``poll_seconds``. The death of process 0, which runs the coordination service, ends the others
    at once (JAX's runtime may end them first, naming it too).

    A process that is alive keeps publishing, whatever its main thread does (compiles, saves,
    long steps): only a process that cannot run Python for ``timeout_seconds`` is taken for dead.

    Args:
      timeout_seconds: how long a process may go without publishing before it is taken for dead.
      poll_seconds: how often each process publishes and reads; ``timeout_seconds / 10`` (at most
        5 s) by default.
      exit_code: this process's exit status when it ends for a peer.

    Returns:
      The running :class:`PeerWatch`. With one process there is nothing to watch: it does nothing.

    Example::

        jax.distributed.initialize()
        with jd.watch_peers(timeout_seconds=60):
            for batch in batches:
                state, metrics = step(state, batch)
    """
    if not timeout_seconds > 0:
        raise ValueError(f"watch_peers: timeout_seconds must be > 0, got {timeout_seconds!r}")
    poll = min(timeout_seconds / 10, 5.0) if poll_seconds is None else poll_seconds
    if not 0 < poll <= timeout_seconds:
        raise ValueError(f"watch_peers: poll_seconds must be in (0, timeout_seconds={timeout_seconds:g}], "
                         f"got {poll_seconds!r}")
    client = _compat.distributed_client() if jax.process_count() > 1 else None
    if jax.process_count() > 1 and client is None:
        raise RuntimeError("watch_peers: this run has several processes but no JAX coordination service; "
                           "call jax.distributed.initialize first")
    return PeerWatch(client if client is not None else _NoPeers(), me=jax.process_index(),
                     count=jax.process_count(), timeout_seconds=timeout_seconds, poll_seconds=poll,
                     exit_code=exit_code, end=_end_process)


class _NoPeers:
    """The key-value store of a one-process run: nothing to publish, no one to read."""

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        pass

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        return []


def _by_process(entries: list[tuple[str, str]]) -> dict[int, str]:
    out = {}
    for key, value in entries:
        name = key.rstrip("/").rsplit("/", 1)[-1]
        if name.isdigit():
            out[int(name)] = value
    return out


def _may_come_from_a_peer(failure: BaseException) -> bool:
    """Whether ``failure``, or an exception it was raised from, is of a kind that a dead peer
    causes: a collective's (``Connection reset by peer``), the coordination service's, a timeout."""
    seen: BaseException | None = failure
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, (jax.errors.JaxRuntimeError, TimeoutError, ConnectionError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _describe(failure: BaseException) -> str:
    first = (str(failure).strip().splitlines() or [""])[0][:300]
    return f"{type(failure).__name__}: {first}" if first else type(failure).__name__


def _end_process(line: str, status: int) -> None:
    # os._exit: the main thread waits in C++ for the dead process and cannot be interrupted, and
    # exit handlers (jax.distributed.shutdown) would wait for it again.
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    os._exit(status)
