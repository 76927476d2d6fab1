"""The heartbeat's step is the loop's: sent as each step completes, never sent backwards."""

from __future__ import annotations

import threading

from fsdp_lab.observe.heartbeat import Heartbeat


class Store:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.broken = False

    def set(self, key: str, value: str) -> None:
        if self.broken:
            raise RuntimeError("Connection reset by peer")
        self.sent.append(value.split()[1])


def test_each_completed_step_is_sent_by_the_loop_at_once():
    store = Store()
    beat = Heartbeat(store, rank=1, interval_s=3600)  # no thread started: the loop alone
    for step in (3, 4, 5):
        beat.step_done(step)
    assert store.sent == ["3", "4", "5"]


def test_a_broken_store_is_left_to_the_thread_until_it_gets_through():
    store = Store()
    beat = Heartbeat(store, rank=0, interval_s=3600)
    store.broken = True
    beat.step_done(1)
    store.broken = False
    beat.step_done(2)  # the loop does not retry a store that failed
    assert store.sent == []
    beat.beat()  # the thread's
    assert store.sent == ["2"]
    beat.step_done(3)  # through again: the loop sends
    assert store.sent == ["2", "3"]


def test_the_loop_never_waits_for_the_thread():
    store = Store()
    beat = Heartbeat(store, rank=0, interval_s=3600)
    with beat._lock:  # the thread is sending
        done = threading.Event()
        threading.Thread(target=lambda: (beat.step_done(7), done.set())).start()
        assert done.wait(5)
    assert store.sent == [] and beat._step == 7
