"""A split server's ranks keep to themselves: rank 0's step messages cross as int64 tensors of a
fixed layout that a following rank reads strictly (a pickle, or anything else, is refused and
nothing of it runs), and the ranks of one machine meet in a store only the server's user can
open. (The live server's listeners: tests/test_tensor_parallel.py.)"""
from __future__ import annotations

import os
import pickle
import re
import stat
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed

from verify_server.engines.step_messages import (
    KINDS, LAYOUT, MAX_PAYLOAD, Copy, PoolSize, RowPlan, Step, Stop, Unreadable, WarmUp, decode,
    encode)
from verify_server.rendezvous import STORE_KEY, Meeting


class Planted:
    """An object whose unpickling creates `marker`: what a pickle can make its reader run."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


MESSAGES = [
    Step((RowPlan((3, 7), 20, (11, 12, 13), True, 0, (), (0, 1)),      # a tree of 3
          RowPlan((4,), 0, (1, 2, 3, 4, 5), False, 0, (), ()),          # a prefill chunk
          RowPlan((5, 6), 16, (9,), True, 2, (1,), ()))),               # a SAT block
    Step(()),
    Copy((40, 41), (33, 34)),
    Copy((), ()),
    WarmUp(64, 2048),
    PoolSize("flex", 80 << 30, 16),
    PoolSize("paged", 1 << 20, 32),
    Stop(),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_as_int64_tensors_and_reads_back_the_same(message):
    header, payload = encode(message)
    assert header.dtype == payload.dtype == torch.int64
    assert header.tolist() == [LAYOUT, KINDS.index(type(message)), len(payload)]
    assert decode(header, payload) == message


def test_a_copy_is_its_source_then_its_dest():
    header, payload = encode(Copy((4, 5), (9, 10)))
    assert header.tolist() == [LAYOUT, 1, 4] and payload.tolist() == [4, 5, 9, 10]


def wire(kind: int, *values: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A header of `kind` (announcing `length` values, else as many as given), and its payload."""
    n = len(values) if length is None else length
    return torch.tensor([LAYOUT, kind, n]), torch.tensor(values, dtype=torch.int64)


STEP, COPY, WARM_UP, POOL_SIZE, STOP = range(len(KINDS))
# A Step of one row: rows; then table length, length, tokens, want_logits, sat_slots, anchors,
# parents; then its table (block 7) and tokens (9)
ONE_ROW = (1, 1, 0, 1, 1, 0, 0, 0, 7, 9)
NOTHING = torch.tensor([], dtype=torch.int64)


def test_a_step_of_one_row_is_laid_out_as_said():
    assert encode(Step((RowPlan((7,), 0, (9,), True, 0, (), ()),)))[1].tolist() == list(ONE_ROW)


@pytest.mark.parametrize("header, payload, said", [
    (torch.tensor([48, 0, 0]), NOTHING, "another layout (0x30"),     # the old wire's first 8 bytes
    (*wire(len(KINDS)), "unknown kind 5"),
    (*wire(-1), "unknown kind -1"),
    (*wire(STEP, length=-1), "a payload of -1 values"),
    (*wire(STEP, length=MAX_PAYLOAD + 1), f"a payload of {MAX_PAYLOAD + 1} values"),
    (torch.tensor([float(LAYOUT), 0.0, 0.0]), NOTHING, "a header of torch.float32 (3,)"),
    (torch.tensor([LAYOUT, STOP, 0, 0]), NOTHING, "a header of torch.int64 (4,)"),
    (*wire(WARM_UP, 1, 2, length=3), "a payload of torch.int64 (2,), not int64 (3,)"),
    (*wire(STEP, *ONE_ROW[:-1], -9), "a negative value"),
    (*wire(STEP, *ONE_ROW[:-1]), "ends early: 1 more values wanted"),
    (*wire(STEP, *ONE_ROW, 0), "values past the message's end: 1"),
    (*wire(STEP, 1, 0, 0, 0, 2, 0, 0, 0), "a flag of 2"),
    (*wire(STEP, 1 << 40, *ONE_ROW[1:]), "ends early"),      # rows it does not carry
    (*wire(COPY, 1, 2, 3), "a Copy of 3 values"),
    (*wire(WARM_UP, 8), "ends early"),
    (*wire(POOL_SIZE, 9, 1 << 20, 16), "an engine kind of 9"),
    (*wire(STOP, 0), "values past the message's end: 1"),
])
def test_a_message_not_in_the_layout_is_refused(header, payload, said):
    with pytest.raises(Unreadable, match=re.escape(said)):
        decode(header, payload)


def test_a_pickle_sent_as_a_step_is_refused_and_nothing_of_it_runs(tmp_path):
    marker = tmp_path / "ran"
    raw = pickle.dumps(Planted(str(marker)))
    payload = torch.frombuffer(bytearray(raw + bytes(-len(raw) % 8)), dtype=torch.int64)
    with pytest.raises(Unreadable):
        decode(torch.tensor([LAYOUT, STEP, len(payload)]), payload)
    assert not marker.exists()


@pytest.mark.parametrize("message, said", [
    (Copy((1, 2), (3,)), "a Copy of 2 slots to 1"),
    (PoolSize("auto-tuned", 1, 16), "engine kind 'auto-tuned'"),
    (WarmUp(-1, 8), "a WarmUp the layout cannot carry"),
])
def test_rank_0_sends_nothing_the_layout_cannot_carry(message, said):
    with pytest.raises(ValueError, match=said):
        encode(message)


# A following rank over a real gloo group: rank 0's steps until Stop, with an engine that only
# says what it was told.
FOLLOWER = """
import sys
import torch.distributed as dist
from verify_server.engines.sharded import Channel, follow
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=1, world_size=2)
class Engine:
    def warm_up(self, max_rows, max_step_tokens):
        print("warmed up", max_rows, max_step_tokens, flush=True)
follow(Engine(), Channel(None))
print("stopped", flush=True)
"""
# A rank 0 that speaks the old wire: a pickle (Planted's), broadcast as torch.distributed
# broadcasts objects
PICKLING_LEADER = """
import sys
import torch.distributed as dist
class Planted:
    def __reduce__(self):
        return open, (sys.argv[2], "w")
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=0, world_size=2)
dist.broadcast_object_list([Planted()], src=0)
"""


def test_a_following_rank_sent_a_pickle_ends_and_nothing_of_it_runs(tmp_path):
    marker, store = tmp_path / "ran", str(tmp_path / "store")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    leader = subprocess.Popen([sys.executable, "-c", PICKLING_LEADER, store, str(marker)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        follower = subprocess.run([sys.executable, "-c", FOLLOWER, store], env=env,
                                  capture_output=True, text=True, timeout=120)
    finally:
        leader.kill()
        leader.wait()
    assert follower.returncode == 70, follower.stderr[-2000:]
    assert "a message from rank 0 could not be read (a header of another layout" in \
        follower.stderr
    assert "warmed up" not in follower.stdout and not marker.exists()


def test_the_ranks_of_one_machine_meet_in_a_folder_only_this_user_can_open():
    meeting = Meeting.open()
    folder = meeting.path.parent
    meeting.store(2).set("rank 0", "here")        # the store's file made, as rank 0 makes it
    mode = folder.stat()
    assert stat.S_IMODE(mode.st_mode) == 0o700 and mode.st_uid == os.getuid()
    assert meeting.environment() == {STORE_KEY: str(meeting.path), "GLOO_SOCKET_IFNAME": "lo",
                                     "NCCL_SOCKET_IFNAME": "lo"}
    meeting.close()
    assert not folder.exists()
    meeting.close()             # once only: a second close is nothing


JOINED, REFUSED = 0, 13


def join_as_nobody(path: str) -> int:
    """JOINED or REFUSED: another user (nobody) opening the store at `path` as a rank would
    (a forked child: the venv's python may be out of that user's reach)."""
    pid = os.fork()
    if pid == 0:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        try:
            torch.distributed.FileStore(path, 2).set("rank 1", "here")
        except RuntimeError as exc:
            os._exit(REFUSED if "Permission denied" in str(exc) else 1)
        os._exit(JOINED)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
def test_another_user_cannot_join_the_ranks_store():
    meeting = Meeting.open()
    try:
        meeting.store(2).set("rank 0", "here")
        assert join_as_nobody(str(meeting.path)) == REFUSED
    finally:
        meeting.close()
    with tempfile.TemporaryDirectory() as shared:       # the check can tell: an open folder
        os.chmod(shared, 0o777)
        assert join_as_nobody(os.path.join(shared, "store")) == JOINED
