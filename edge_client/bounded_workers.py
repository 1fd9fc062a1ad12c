"""Work done in child processes whose memory and time are bounded, so that what untrusted work
(a chat template from a server) allocates or spends never lands in the process that serves:

    workers = BoundedWorkers("edge_client.chat_render:render_request", memory=128 << 20,
                             seconds=2.0, size=2, max_reply=16 << 20)
    reply = workers.run(request)       # TARGET(request) in a worker: bytes in, bytes out

A worker is this Python with this process's import path (what imports here imports there; not
the current directory as `-m` would add): it imports TARGET, limits its own address space
(RLIMIT_AS) to what it maps then plus MEMORY bytes, says it is ready, and answers requests one
at a time on its stdin and stdout (frames: 8 bytes of length, then the bytes).
The bound holds for everything alive at once, whatever builds it. run() raises
WorkerOverBudget, naming the bound, when the target's MemoryError ends its worker (memory), when
no reply comes within SECONDS (seconds: the worker is killed), or when a worker dies or replies
more than MAX_REPLY bytes (stopped: killed); the next request gets a fresh worker.

Up to SIZE workers run at once, each started when first needed and kept for the next requests;
a request beyond them waits for one. A worker runs in a session of its own (a terminal's Ctrl-C
is for the daemon) and leaves when its stdin closes: when the daemon exits, even killed. A child
the daemon forks owns none of them: it closes its copies of their pipes and starts with empty
pools. Pools are stopped at exit; one no longer used is not kept alive for that.
Linux only: the bound reads /proc/self/statm.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import resource
import select
import struct
import subprocess
import sys
import threading
import time
import weakref

FRAME = struct.Struct("!Q")             # the length before every frame's bytes
READY, REPLY, OUT_OF_MEMORY = b"+", b"R", b"M"   # the first byte of a worker's frame
START_SECONDS = 60.0                     # for a worker to import its target (a busy Pi, a cold disk)
STOP_SECONDS = 1.0                       # for a worker to leave once its stdin is closed
# What a worker runs: ARGV is this process's import path (JSON), TARGET, MEMORY.
BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "from edge_client.bounded_workers import main; sys.exit(main(sys.argv[2:]))")


class WorkerOverBudget(Exception):
    """A request past a worker's bound: `bound` is "memory", "seconds" or "stopped"."""

    def __init__(self, bound: str, message: str) -> None:
        super().__init__(message)
        self.bound = bound


class BoundedWorkers:
    """Up to SIZE workers running TARGET ("module:function", bytes -> bytes), each within
    MEMORY bytes beyond its start and SECONDS per request."""

    def __init__(self, target: str, memory: int, seconds: float, size: int, max_reply: int) -> None:
        self.target, self.memory, self.seconds, self.max_reply = target, memory, seconds, max_reply
        self.size = size
        self._start_empty()
        _POOLS.add(self)

    def run(self, request: bytes) -> bytes:
        """TARGET(REQUEST) in a worker; WorkerOverBudget past a bound."""
        with self._slots:
            worker = self._take()
            try:
                reply = worker.exchange(request, self.seconds, self.max_reply)
            except BaseException:
                worker.kill()
                raise
            with self._lock:
                self._idle.append(worker)
            return reply

    def close(self) -> None:
        """Every idle worker stopped (a busy one is killed where its request ends)."""
        with self._lock:
            idle, self._idle[:] = list(self._idle), []
        for worker in idle:
            worker.stop()

    def _start_empty(self) -> None:
        """No worker, every slot free: a new pool, or a forked child's (where the parent's
        threads that held slots or the lock are gone)."""
        self._slots = threading.BoundedSemaphore(self.size)
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.process.poll() is None:
                    return worker
                worker.kill()
        return _Worker(self.target, self.memory)


class _Worker:
    """One worker process and its two pipes."""

    def __init__(self, target: str, memory: int) -> None:
        self.memory = memory
        self.process = subprocess.Popen(
            [sys.executable, "-c", BOOT, json.dumps(sys.path), target, str(memory)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        _WORKERS.add(self)
        self._poll = select.poll()
        self._poll.register(self.process.stdout.fileno(), select.POLLIN)
        try:
            ready = self._receive(time.monotonic() + START_SECONDS, len(READY))
        except WorkerOverBudget:
            self.kill()
            raise RuntimeError(f"a worker process for {target} did not start (its error is above "
                               f"on stderr)") from None
        if ready != READY:
            self.kill()
            raise RuntimeError(f"a worker process for {target} did not start: it said {ready[:32]!r}")

    def exchange(self, request: bytes, seconds: float, max_reply: int) -> bytes:
        """REQUEST sent, its reply read within SECONDS."""
        try:
            self._send(request)
        except OSError:     # it left while idle (killed from outside)
            raise WorkerOverBudget("stopped", "the worker process had stopped") from None
        reply = self._receive(time.monotonic() + seconds, len(REPLY) + max_reply)
        if reply[:1] == OUT_OF_MEMORY:
            raise WorkerOverBudget("memory", f"the work holds more than {self.memory} bytes at once")
        if reply[:1] != REPLY:
            raise WorkerOverBudget("stopped", f"the worker process replied {reply[:32]!r}")
        return reply[1:]

    def _send(self, request: bytes) -> None:
        fd = self.process.stdin.fileno()
        view = memoryview(FRAME.pack(len(request)) + request)
        while view:
            view = view[os.write(fd, view):]

    def _receive(self, deadline: float, max_reply: int) -> bytes:
        size, = FRAME.unpack(self._read(FRAME.size, deadline))
        if size > max_reply:
            raise WorkerOverBudget("stopped", f"the worker process replied {size} bytes (at most "
                                              f"{max_reply})")
        return self._read(size, deadline)

    def _read(self, count: int, deadline: float) -> bytes:
        data, fd = bytearray(), self.process.stdout.fileno()
        while len(data) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(left * 1000):
                raise WorkerOverBudget("seconds", "the worker process did not reply in time")
            chunk = os.read(fd, min(count - len(data), 1 << 20))
            if not chunk:
                raise WorkerOverBudget("stopped", "the worker process stopped")
            data += chunk
        return bytes(data)

    def kill(self) -> None:
        self.process.kill()
        self._reap()

    def stop(self) -> None:
        """Asked to leave (its stdin closed), killed if it does not."""
        try:
            self.process.stdin.close()
            self.process.wait(STOP_SECONDS)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self._reap()

    def _reap(self) -> None:
        self.process.wait()
        self.close_pipes()

    def close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:
                pass


# Every pool and worker alive, for the two hooks below (weakly: a pool no longer used goes).
_POOLS: weakref.WeakSet[BoundedWorkers] = weakref.WeakSet()
_WORKERS: weakref.WeakSet[_Worker] = weakref.WeakSet()


def _close_pools() -> None:
    """At exit: every pool's idle workers stopped."""
    for pool in list(_POOLS):
        pool.close()


def _forget_in_child() -> None:
    """In a forked child: no copy of a worker's pipe kept open (the worker leaves when the
    daemon's copy closes), and every pool empty."""
    for worker in list(_WORKERS):
        worker.close_pipes()
    for pool in list(_POOLS):
        pool._start_empty()


atexit.register(_close_pools)
os.register_at_fork(after_in_child=_forget_in_child)


# -- in the worker ----------------------------------------------------------------------------
def main(argv: list[str]) -> int:
    """A worker: TARGET imported, the address space bounded, then one reply per request until
    stdin closes; after a MemoryError it answers OUT_OF_MEMORY and leaves."""
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr                        # the reply pipe carries frames only
    module, _, function = argv[0].partition(":")
    target = getattr(importlib.import_module(module), function)
    try:
        _bound_address_space(int(argv[1]))
    except RuntimeError as exc:
        print(f"sled: {exc}", file=sys.stderr)
        return 2
    _write_frame(replies, READY)
    return serve(target, requests, replies)


def serve(target, requests, replies) -> int:
    """One reply per request until REQUESTS ends; after a MemoryError, OUT_OF_MEMORY and the
    end."""
    while (request := _read_frame(requests)) is not None:
        out_of_memory = False
        try:
            reply = target(request)
        except MemoryError:
            out_of_memory = True     # answered once its traceback, and all it holds, is gone
        if out_of_memory:
            _write_frame(replies, OUT_OF_MEMORY)
            return 0
        _write_frame(replies, REPLY, reply)
    return 0


def _bound_address_space(room: int) -> None:
    """This process may map what it maps now plus ROOM bytes (RLIMIT_AS, soft and hard)."""
    try:
        with open("/proc/self/statm") as statm:
            mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        raise RuntimeError("bounding a worker's memory needs Linux (/proc/self/statm)") from None
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped + room if hard == resource.RLIM_INFINITY else min(hard, mapped + room)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _read_frame(stream) -> bytes | None:
    """The next frame's bytes, None at the end of the stream."""
    header = stream.read(FRAME.size)
    if len(header) < FRAME.size:
        return None
    size, = FRAME.unpack(header)
    data = stream.read(size)
    return data if len(data) == size else None


def _write_frame(stream, *parts: bytes) -> None:
    stream.write(FRAME.pack(sum(map(len, parts))))
    for part in parts:
        stream.write(part)
    stream.flush()

