"""``client/_fetched.py``: the ids of transient outputs fetched, waiting for a call to
delete them. (Over the real path: tests/server/test_no_result_lost.py.)"""

from __future__ import annotations

import gc
import time
import types
import weakref

import numpy as np
import pytest

import gradserve
from gradserve.client._fetched import Fetched
from gradserve.errors import InvalidArgumentError, SessionLostError, UnavailableError


class Deleter:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.deleted: list[list[str]] = []

    def delete(self, ids: list[str]) -> None:
        if self.fail:
            raise UnavailableError("the server is unreachable")
        self.deleted.append(ids)


def test_a_flush_that_fails_keeps_the_ids_for_the_next_call():
    deleter = Deleter(fail=True)
    fetched = Fetched(deleter.delete, flush_seconds=60)
    fetched.add("a")
    fetched.add("b")
    fetched.flush()
    assert len(fetched) == 2  # not lost: the next call carries them
    deleter.fail = False
    fetched.flush()
    assert deleter.deleted == [["a", "b"]] and len(fetched) == 0
    fetched.close()


def test_ids_no_call_takes_are_deleted_after_the_flush_delay():
    deleter = Deleter(fail=False)
    fetched = Fetched(deleter.delete, flush_seconds=0.05)
    fetched.add("x")
    end = time.monotonic() + 10
    while not deleter.deleted and time.monotonic() < end:
        time.sleep(0.01)
    assert deleter.deleted == [["x"]] and len(fetched) == 0
    fetched.close()


def test_take_and_give_back_keep_the_order():
    fetched = Fetched(Deleter(fail=False).delete, flush_seconds=60)
    for i in "abc":
        fetched.add(i)
    assert fetched.take(limit=2) == ["a", "b"]
    fetched.give_back(["a", "b"])
    assert fetched.take() == ["a", "b", "c"]
    fetched.close()


def test_an_unclosed_client_is_not_kept_alive_by_its_flush_thread(target):
    c = gradserve.Client(target, keepalive=False, shared_memory=False)
    ref = c.put(np.ones(1000, np.float32))
    c._fetch(ref.id, delete_after=True)  # starts the flush thread
    gone = weakref.ref(c)
    del c, ref
    gc.collect()
    assert gone() is None


def test_ids_taken_lately_are_carried_again_after_a_call_failed_unavailable(monkeypatch):
    """A server restarted from a snapshot older than its deletes holds those ids
    again: after an UNAVAILABLE they are carried again, once per outage (until a call
    gets through), those taken more than ``RESEND_SECONDS`` ago or past
    ``MAX_REMEMBERED`` forgotten."""
    from gradserve.client import _fetched

    clock = [1000.0]
    monkeypatch.setattr(_fetched, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(_fetched, "MAX_REMEMBERED", 3)
    fetched = Fetched(Deleter(fail=False).delete, flush_seconds=60)
    fetched.add("old")
    assert fetched.take() == ["old"]
    clock[0] += _fetched.RESEND_SECONDS - 1
    fetched.add("a", "b")
    assert fetched.take() == ["a", "b"]
    clock[0] += 2  # "old" was taken RESEND_SECONDS + 1 ago
    fetched.add("pending")
    fetched.resend_recent()
    fetched.resend_recent()  # the same outage: nothing more
    assert fetched.take() == ["pending", "a", "b"]
    fetched.reachable()  # a call got through
    fetched.add("c", "d")
    assert fetched.take() == ["c", "d"]  # three remembered: the oldest went
    fetched.resend_recent()
    assert fetched.take() == ["b", "c", "d"]
    fetched.add("e")
    in_flight = fetched.take()
    fetched.reachable()
    fetched.resend_recent()  # the call carrying "e" fails UNAVAILABLE
    fetched.give_back(in_flight)  # and gives it back: carried once
    assert fetched.take() == ["c", "d", "e"]
    fetched.close()


def test_the_idle_flush_tries_again_after_pauses_that_double_until_it_deletes():
    """A client idle through a restart still deletes what it had to (the ids a
    restart from an older snapshot brought back: ``resend_recent``), without asking
    a server that is down four times a second (a review helper: a failed flush woke
    the flush again)."""
    attempts: list[float] = []

    class Down(Deleter):
        def delete(self, ids: list[str]) -> None:
            attempts.append(time.monotonic())
            super().delete(ids)

    deleter = Down(fail=True)
    fetched = Fetched(deleter.delete, flush_seconds=0.02)
    fetched.add("x")
    time.sleep(1.0)
    # 0.02 s, then pauses of 0.04, 0.08, 0.16, 0.32, 0.64: at most 6 tries in 1 s
    # (50 at a fixed 0.02 s).
    assert 2 <= len(attempts) <= 6
    deleter.fail = False
    end = time.monotonic() + 10
    while not deleter.deleted and time.monotonic() < end:
        time.sleep(0.01)
    assert deleter.deleted == [["x"]] and len(fetched) == 0
    fetched.close()


def test_the_idle_flush_tries_again_only_while_the_server_is_out_of_reach(monkeypatch):
    """A session that is gone has nothing left to delete (its ids are dropped), and a
    delete refused for another reason waits for the next call: only UNAVAILABLE is
    tried again (a review helper: a lost session's ids were tried every 30 s for
    the client's life). The pause is capped without overflowing: a thousand failed
    tries (a night of a server down) killed the flush thread."""
    from gradserve.client import _fetched

    class Failing(Deleter):
        def __init__(self, error: Exception) -> None:
            super().__init__(fail=False)
            self.error: Exception | None = error
            self.tries = 0

        def delete(self, ids: list[str]) -> None:
            self.tries += 1
            if self.error is not None:
                raise self.error
            super().delete(ids)

    def first_try(failing: Failing) -> None:
        end = time.monotonic() + 10
        while not failing.tries and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.3)  # (a second try would come within 0.02 s)

    lost = Failing(SessionLostError("session lost"))
    fetched = Fetched(lost.delete, flush_seconds=0.01)
    fetched.add("x")
    first_try(lost)
    assert lost.tries == 1 and len(fetched) == 0  # dropped
    fetched.close()

    refused = Failing(InvalidArgumentError("no"))
    fetched = Fetched(refused.delete, flush_seconds=0.01)
    fetched.add("x")
    first_try(refused)
    assert refused.tries == 1 and len(fetched) == 1  # for the next call
    fetched.close()

    monkeypatch.setattr(_fetched, "MAX_FLUSH_PAUSE_SECONDS", 0.0005)
    down = Failing(UnavailableError("down"))
    fetched = Fetched(down.delete, flush_seconds=0.0001)
    fetched.add("x")
    end = time.monotonic() + 30
    while down.tries < 1100 and time.monotonic() < end:
        time.sleep(0.05)
    assert down.tries >= 1100
    down.error = None
    end = time.monotonic() + 10
    while not down.deleted and time.monotonic() < end:
        time.sleep(0.01)
    assert down.deleted == [["x"]]
    fetched.close()


def test_an_outage_is_over_once_a_call_gets_through():
    fetched = Fetched(Deleter(fail=False).delete, flush_seconds=60)
    assert not fetched.out_of_reach
    fetched.resend_recent()
    assert fetched.out_of_reach  # calls leave what they cannot carry to the idle flush
    fetched.reachable()
    assert not fetched.out_of_reach
    fetched.close()


def test_an_outage_is_over_once_the_server_answers_even_with_an_error(target):
    """Any answer of the server ends an outage, not only a call that succeeds: the
    first call after a restart may well be refused (a review helper)."""
    with gradserve.Client(target, shared_memory=False) as client:
        ref = client.put(np.ones(3, np.float32))
        client.delete(ref)
        client._fetched.resend_recent()  # as a call that failed UNAVAILABLE does
        assert client._fetched.out_of_reach
        with pytest.raises(gradserve.errors.NotFoundError):
            client.get(ref)
        assert not client._fetched.out_of_reach
