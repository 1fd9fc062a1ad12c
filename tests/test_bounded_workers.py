"""Work in bounded worker processes (edge_client.bounded_workers): a reply comes back from a
worker kept for the next request; past its memory, its time, or when it dies, the request is a
WorkerOverBudget naming the bound, the worker is gone and the next request gets a fresh one; no
more workers run than the pool's size. The targets below run inside the workers."""
from __future__ import annotations

import os
import threading
import time

import pytest

from edge_client.bounded_workers import BoundedWorkers, WorkerOverBudget

HERE = "tests.test_bounded_workers"
MIB = 1 << 20


# -- targets, run in a worker -----------------------------------------------------------------
def pid(request: bytes) -> bytes:
    time.sleep(float(request or 0))
    return str(os.getpid()).encode()


def hold(request: bytes) -> bytes:
    """REQUEST MiB held at once, one MiB at a time."""
    held = [bytes(MIB) for _ in range(int(request))]
    return str(len(held)).encode()


def echo(request: bytes) -> bytes:
    return request


def leave(request: bytes) -> bytes:
    os._exit(3)


def workers(function: str, **bounds) -> BoundedWorkers:
    settings = {"memory": 64 * MIB, "seconds": 10.0, "size": 2, "max_reply": MIB, **bounds}
    return BoundedWorkers(f"{HERE}:{function}", **settings)


# -- tests --------------------------------------------------------------------------------------
def test_a_reply_comes_back_from_a_worker_kept_for_the_next_request():
    pool = workers("pid")
    try:
        first, second = pool.run(b""), pool.run(b"")
        assert first == second and int(first) != os.getpid()
    finally:
        pool.close()


def test_past_its_memory_a_worker_answers_and_leaves_and_the_next_request_gets_a_fresh_one():
    pool = workers("hold")
    try:
        assert pool.run(b"32") == b"32"                  # within 64 MiB
        started = time.perf_counter()
        with pytest.raises(WorkerOverBudget) as over:
            pool.run(b"4096")                            # 4 GiB, at once
        assert over.value.bound == "memory" and time.perf_counter() - started < 10
        assert pool.run(b"32") == b"32"
    finally:
        pool.close()


def test_past_its_time_a_worker_is_killed():
    pool = workers("pid", seconds=0.5)
    try:
        before = int(pool.run(b""))
        started = time.perf_counter()
        with pytest.raises(WorkerOverBudget) as over:
            pool.run(b"30")
        assert over.value.bound == "seconds" and time.perf_counter() - started < 5
        assert _zombie_or_gone(before)
        assert int(pool.run(b"")) != before
    finally:
        pool.close()


def test_a_worker_that_dies_or_replies_too_much_is_stopped():
    pool = workers("leave")
    try:
        with pytest.raises(WorkerOverBudget) as over:
            pool.run(b"")
        assert over.value.bound == "stopped"
    finally:
        pool.close()
    pool = workers("echo", max_reply=100)
    try:
        assert pool.run(b"x" * 100) == b"x" * 100
        with pytest.raises(WorkerOverBudget) as over:
            pool.run(b"x" * 101)
        assert over.value.bound == "stopped"
        assert pool.run(b"again") == b"again"
    finally:
        pool.close()


def test_no_more_workers_run_than_the_pool_size():
    pool = workers("pid", size=2)
    pids: list[bytes] = []
    try:
        pool.run(b""), pool.run(b"")                    # started before the clock
        threads = [threading.Thread(target=lambda: pids.append(pool.run(b"0.3"))) for _ in range(6)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        took = time.perf_counter() - started
    finally:
        pool.close()
    assert len(pids) == 6 and len(set(pids)) <= 2 and took >= 0.85, (set(pids), took)


def test_a_worker_that_cannot_start_says_so_in_one_line():
    pool = BoundedWorkers("tests.no_such_module:f", memory=64 * MIB, seconds=1.0, size=1,
                          max_reply=MIB)
    with pytest.raises(RuntimeError, match="did not start") as raised:
        pool.run(b"")
    assert "\n" not in str(raised.value)


def test_closing_the_pool_ends_its_workers():
    pool = workers("pid")
    worker = int(pool.run(b""))
    pool.close()
    assert _zombie_or_gone(worker)


def _zombie_or_gone(pid_: int) -> bool:
    try:
        with open(f"/proc/{pid_}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
