"""Work in bounded worker processes (edge_client.bounded_workers): a reply comes back from a
worker kept for the next request; past its memory, its time, or when it dies, the request is a
WorkerOverBudget naming the bound, the worker is gone and the next request gets a fresh one; no
more workers run than the pool's size. A worker answers that it ran out of memory once what
its target held is let go; it leaves with the daemon even when the daemon has forked a child
that lives on; a pool no longer used is not kept alive. The workers run tests/bounded_targets.py
(light to import: each worker imports it at its start)."""
from __future__ import annotations

import gc
import io
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest

from edge_client.bounded_workers import FRAME, OUT_OF_MEMORY, BoundedWorkers, WorkerOverBudget, serve
from tests.conftest import zombie_or_gone

TARGETS = "tests.bounded_targets"      # what the workers run
MIB = 1 << 20


def workers(function: str, **bounds) -> BoundedWorkers:
    settings = {"memory": 64 * MIB, "seconds": 10.0, "size": 2, "max_reply": MIB, **bounds}
    return BoundedWorkers(f"{TARGETS}:{function}", **settings)


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
        assert zombie_or_gone(before)
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
    assert zombie_or_gone(worker)


class _Held:
    """What a target holds when it runs out of memory."""


def test_a_worker_lets_go_of_what_its_target_held_before_it_answers_out_of_memory():
    held: list[weakref.ref] = []
    alive_at_answer: list[bool] = []

    def run_out(request: bytes) -> bytes:
        memory = _Held()
        held.append(weakref.ref(memory))
        raise MemoryError

    class Replies(io.BytesIO):
        def write(self, data) -> int:
            alive_at_answer.append(held[0]() is not None)
            return super().write(data)

    requests, replies = io.BytesIO(FRAME.pack(1) + b"x" + FRAME.pack(1) + b"y"), Replies()
    assert serve(run_out, requests, replies) == 0
    assert replies.getvalue() == FRAME.pack(1) + OUT_OF_MEMORY and len(held) == 1   # then it left
    assert alive_at_answer and not any(alive_at_answer)


# A daemon forks a child that lives on while its worker is busy (a request in another thread),
# then is killed (no atexit); it prints the worker's pid and the child's.
FORKS = f"""
import os, threading, time
from edge_client.bounded_workers import BoundedWorkers
pool = BoundedWorkers("{TARGETS}:pid", memory={64 * MIB}, seconds=10.0, size=1, max_reply={MIB})
worker = pool.run(b"").decode()
threading.Thread(target=pool.run, args=(b"1",), daemon=True).start()
time.sleep(0.3)
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(worker, child, flush=True)
os._exit(0)
"""


def test_a_worker_leaves_with_the_daemon_though_a_child_it_forked_lives_on():
    daemon = subprocess.Popen([sys.executable, "-c", FORKS], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    with daemon.stdout:
        worker, child = map(int, daemon.stdout.readline().split())
    daemon.wait(30)
    try:
        deadline = time.monotonic() + 5
        while not zombie_or_gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert zombie_or_gone(worker) and not zombie_or_gone(child)
    finally:
        for pid_ in (child, worker):
            if not zombie_or_gone(pid_):
                os.kill(pid_, signal.SIGKILL)


def test_a_pool_no_longer_used_is_not_kept_alive():
    pool = workers("pid")
    pool.run(b"")
    pool.close()
    dropped = weakref.ref(pool)
    del pool
    gc.collect()
    assert dropped() is None
