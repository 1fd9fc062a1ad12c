"""lab.waiting: the lab's one wait loop. It returns what the check found, says what it waited
for when time runs out, and lets a check's own error end the wait at once."""
from __future__ import annotations

import time

import pytest

from lab.waiting import wait_until, wait_until_sync


async def test_the_first_value_is_returned_and_none_is_waited_past():
    answers = iter([None, None, {}, "late"])

    async def check():
        return next(answers)
    assert await wait_until(check, timeout_s=5, what="x", interval_s=0.01) == {}


async def test_time_running_out_names_what_was_waited_for():
    async def never():
        return None
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^the broker did not listen within 0\.2 s$"):
        await wait_until(never, timeout_s=0.2, what="the broker did not listen", interval_s=0.05)
    assert 0.2 <= time.monotonic() - started < 2.0


async def test_an_error_of_the_check_ends_the_wait_at_once():
    calls = []

    async def dies():
        calls.append(1)
        raise RuntimeError("the process exited at start")
    with pytest.raises(RuntimeError, match="exited at start"):
        await wait_until(dies, timeout_s=60, what="x")
    assert calls == [1]


def test_the_loop_without_an_event_loop_gives_none_when_time_runs_out():
    answers = iter([None, 7])
    assert wait_until_sync(lambda: next(answers), timeout_s=5, interval_s=0.01) == 7
    assert wait_until_sync(lambda: None, timeout_s=0.1, interval_s=0.02) is None
