"""watch_peers: the decision (PeerTracker) on a clock the test sets, and the watch's thread on a
fake key-value store with a recording ``end``; real processes are in test_multiprocess.py."""

import threading
import time

import jax
import pytest

import jax_drain as jd
from jax_drain.peers import PeerTracker, PeerWatch


def test_a_peer_is_gone_only_once_its_beat_stops_for_the_timeout():
    tracker = PeerTracker(me=0, count=3, timeout_seconds=3.0, started=0.0)
    for t in range(10):  # process 1 beats every second; process 2 stops after its first beat
        values = {0: "x", 1: str(t), 2: "0"}
        gone = tracker.observe(values, now=float(t))
        if t <= 3:
            assert gone == [], t
        else:
            assert gone == [f"process 2 of 3 stopped answering: no sign of life for {t} s (it was killed, ran "
                            "out of memory, or its host or network is down)"], t


def test_a_finished_peer_is_never_reported_and_a_failed_one_at_once():
    tracker = PeerTracker(me=1, count=3, timeout_seconds=3.0, started=0.0)
    assert tracker.observe({0: "finished", 1: "0", 2: "5"}, now=0.0) == []
    assert tracker.observe({0: "finished", 1: "0", 2: "failed: ValueError: a bad batch"}, now=0.5) == \
        ["process 2 of 3 failed with ValueError: a bad batch"]
    assert tracker.observe({0: "finished", 1: "0", 2: "6"}, now=100.0) == []  # its own key is never judged


def test_a_peer_that_never_published_is_reported_after_the_timeout_from_the_start():
    tracker = PeerTracker(me=0, count=2, timeout_seconds=3.0, started=10.0)
    assert tracker.observe({0: "1"}, now=12.9) == []
    (gone,) = tracker.observe({0: "2"}, now=13.5)
    assert gone.startswith("process 1 of 2 has published nothing for 4 s") and "every process must" in gone


class FakeStore:
    """The coordination service's key-value store, as the watch uses it; ``fail`` makes it gone."""

    def __init__(self):
        self.values, self.fail, self.lock = {}, False, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            if self.fail:
                raise ConnectionError("Socket closed")
            assert allow_overwrite or key not in self.values
            self.values[key] = value

    def key_value_dir_get(self, prefix):
        with self.lock:
            if self.fail:
                raise ConnectionError("Socket closed")
            return [(k, v) for k, v in self.values.items() if k.startswith(prefix)]


def _watch(store, monkeypatch, *, timeout=0.5, poll=0.05):
    """Process 0 of 2 watching ``store``; ``ended`` gets (line, status) where a real watch exits."""
    import atexit

    monkeypatch.setattr(atexit, "register", lambda f: f)  # no exit handler left in the test process
    ended, done = [], threading.Event()

    def end(line, status):
        ended.append((line, status))
        done.set()

    watch = PeerWatch(store, me=0, count=2, timeout_seconds=timeout, poll_seconds=poll, exit_code=9, end=end)
    return watch, ended, done


def test_the_watch_ends_this_process_when_a_peer_stops_beating(monkeypatch):
    store = FakeStore()
    store.values["jax_drain/peers/1"] = "0"  # published once, then died
    start = time.monotonic()
    watch, ended, done = _watch(store, monkeypatch, timeout=0.5, poll=0.05)
    assert done.wait(5), "the watch never reported the dead peer"
    took = time.monotonic() - start
    ((line, status),) = ended
    assert status == 9 and line.startswith("jax_drain.watch_peers: process 1 of 2 stopped answering")
    assert "Restart every process; jax_drain.restore_checkpoint restores the newest complete step" in line
    assert 0.5 <= took < 0.5 + 2 * 0.05 + 1.0, took
    assert store.values["jax_drain/peers/0"] not in ("0", "finished"), "this process did not beat"


def test_the_watch_publishes_how_its_block_ended(monkeypatch):
    store = FakeStore()
    with _watch(store, monkeypatch, timeout=60)[0]:
        store.values["jax_drain/peers/1"] = "0"
    assert store.values["jax_drain/peers/0"] == "finished"
    with pytest.raises(ValueError, match="a bad batch"):
        with _watch(store, monkeypatch, timeout=60)[0]:
            raise ValueError("a bad batch 3\nsecond line")
    assert store.values["jax_drain/peers/0"] == "failed: ValueError: a bad batch 3"


def test_a_collective_error_is_blamed_on_the_dead_peer_not_published_as_this_process_s(monkeypatch):
    """``Connection reset by peer`` in this process's collective: the watch waits for the peer's
    beat to go stale and ends naming the peer (and its own error); the survivors do not blame
    each other. An error no peer explains is published once the timeout passes."""
    store = FakeStore()
    store.values["jax_drain/peers/1"] = "0"
    watch, ended, _ = _watch(store, monkeypatch, timeout=0.3, poll=0.05)
    reset = jax.errors.JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection reset by peer")
    watch.stop(reset)
    ((line, _),) = ended
    assert line.startswith("jax_drain.watch_peers: process 1 of 2 stopped answering")
    assert "Process 0 (its own error, from that: JaxRuntimeError: UNKNOWN: Gloo AllGather failed" in line

    store = FakeStore()
    watch, ended, _ = _watch(store, monkeypatch, timeout=0.3, poll=0.05)
    beating = threading.Event()

    def peer():
        beat = 0
        while not beating.wait(0.02):
            beat += 1
            store.key_value_set("jax_drain/peers/1", str(beat), allow_overwrite=True)

    threading.Thread(target=peer, daemon=True).start()
    try:
        start = time.monotonic()
        watch.stop(TimeoutError("barrier timed out"))
    finally:
        beating.set()
    assert ended == [] and time.monotonic() - start >= 0.3
    assert store.values["jax_drain/peers/0"] == "failed: TimeoutError: barrier timed out"


def test_the_watch_ends_this_process_when_the_coordination_service_is_gone(monkeypatch):
    store = FakeStore()
    watch, ended, done = _watch(store, monkeypatch, timeout=60, poll=0.05)
    store.fail = True
    assert done.wait(5)
    ((line, _),) = ended
    assert line.startswith("jax_drain.watch_peers: the coordination service (process 0) stopped answering "
                           "(ConnectionError: Socket closed)")
    watch.stop(ValueError("raised after the service went"))  # no error of its own over the caller's


def test_watch_peers_in_one_process_watches_nothing_and_checks_its_arguments():
    with jd.watch_peers(timeout_seconds=0.2, poll_seconds=0.01) as watch:
        time.sleep(0.1)
    assert isinstance(watch, jd.PeerWatch) and watch.timeout_seconds == 0.2
    watch.stop()  # idempotent
    assert not any(t.name == "jax_drain.watch_peers" for t in threading.enumerate())
    with pytest.raises(ValueError, match="timeout_seconds must be > 0"):
        jd.watch_peers(timeout_seconds=0)
    with pytest.raises(ValueError, match=r"poll_seconds must be in \(0, timeout_seconds=1\]"):
        jd.watch_peers(timeout_seconds=1, poll_seconds=2)
