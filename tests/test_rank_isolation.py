"""A split server's ranks keep to themselves: rank 0's step messages cross as int64 tensors of a
fixed layout that a following rank reads strictly (a pickle, or anything else, is refused and
nothing of it runs) and checks against its own limits (a block id off its pool, a token off its
vocabulary, a warm-up or pool past its settings and memory: refused, nothing of it run), and
the ranks of one machine meet in a store only the server's user can open. (The live server's
listeners: tests/test_tensor_parallel.py.)"""
from __future__ import annotations

import os
import pickle
import re
import stat
import subprocess
import sys
import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed

from lab.tiny import make_model
from verify_server import follower
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.kv import SessionKV
from verify_server.engines.rows import Row
from verify_server.engines.step_checks import Limits, OutOfBounds, check
from verify_server.engines.step_messages import (
    KINDS, LAYOUT, Copy, PoolSize, RowPlan, Step, Stop, Unreadable, WarmUp, decode, encode,
    payload_length)
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


# A following rank's own limits over a real pool of 8 blocks of 4 slots: blocks 1..7 (block 0 is
# the zero block), slots 4..31; steps of 4 rows of 12 entries; 100 token ids, 2 SAT slots.
def small_pool() -> BlockPool:
    return BlockPool(KVShape(1, 1, 4, torch.float32), num_blocks=8, block_tokens=4)


SETTINGS = Limits(max_rows=4, max_step_tokens=12, block_tokens=4, engine="paged", vocab_size=100,
                  sat_slots=2, pool_bytes=1 << 20)
LIMITS = SETTINGS.with_pool(small_pool())
HUGE = 1 << 40


def row(table=(7,), length=0, tokens=(9,), sat_slots=0, anchors=(), parents=()) -> RowPlan:
    return RowPlan(tuple(table), length, tuple(tokens), True, sat_slots, tuple(anchors),
                   tuple(parents))


def test_rank_0s_own_rows_and_copies_are_within_a_following_ranks_limits():
    pool = small_pool()
    copies = []
    pool.followers = SimpleNamespace(copy=lambda source, dest: copies.append(
        Copy(tuple(source.tolist()), tuple(dest.tolist()))))
    rows = []
    for tokens, sat_slots, anchors, parents in [((5, 6, 7, 8, 9), 0, (), ()),     # a prefill chunk
                                                ((5, 6, 7), 2, (1, 2, 3), ()),    # SAT blocks
                                                ((5, 6, 7, 8), 0, (), (0, 0, 2))]:  # a tree
        kv = SessionKV(pool)
        rows.append(Row(kv, list(tokens), True, sat_slots, anchors, parents))
        kv.admit([], 1 + rows[-1].width, b"")      # a token of context, then the row
        kv.slots(0, 1)
        kv.commit(1)
    step = Step(tuple(RowPlan.of(r) for r in rows))
    rows[2].kv.keep_path([2, 3])           # the tree's accepted path moves: one Copy
    limits = SETTINGS.with_pool(pool)
    for message in (PoolSize("paged", 1 << 20, 4), WarmUp(4, 12), step, *copies, Stop()):
        check(decode(*encode(message)), SETTINGS if isinstance(message, PoolSize) else limits)
    assert len(copies) == 1


def test_the_largest_step_rank_0_can_send_fits_the_payload_a_following_rank_allots():
    """max_rows rows, each of every block of the pool (a shared prefix) and a tree of
    max_step_tokens entries: the longest Step these limits take, within their payload bound."""
    largest = Step((row(range(1, 8), 16, range(12), parents=range(11)),) * 4)
    check(largest, LIMITS)
    header, payload = encode(largest)
    assert payload_length(header, LIMITS) == len(payload) <= LIMITS.max_values(Step)


@pytest.mark.parametrize("message, said", [
    # a block id past the pool: mirrored as block * 16 + slot in int64 (16-token blocks), 2**60 + 5
    # wraps to block 5 (another session's KV) and 3 * 2**59 to negative slots, read from the end
    (Step((row(table=((1 << 60) + 5,)),)), "block 1152921504606846981 in its table (the pool's "
                                           "are 1..7)"),
    (Step((row(table=(3 << 59,)),)), "block 1729382256910270464 in its table"),
    (Step((row(table=(0,)),)), "block 0 in its table"),
    (Step((row(table=(3, 8)),)), "block 8 in its table"),
    (Step((row(table=range(1, 9)),)), "a table of 8 blocks (the pool has 7)"),
    (Step((row(length=HUGE),)), "1 entries after 1099511627776 tokens, past its table's 4 slots"),
    (Step((row(length=3, tokens=(9, 9)),)), "2 entries after 3 tokens, past its table's 4 slots"),
    (Step((row(sat_slots=HUGE),)), "1099511627776 SAT slots (the target has 2)"),
    (Step((row(table=(1, 2, 3, 4), tokens=range(13)),)), "13 entries (1..12 a row)"),
    (Step((row(tokens=()),)), "0 entries (1..12 a row)"),
    (Step((row(tokens=(9, 100)),)), "token id 100 (the vocabulary has 100)"),
    (Step((row(tokens=(9, 9, 9), sat_slots=1, anchors=(2, 1)),)), "SAT anchors (2, 1): not "
                                                                   "increasing within its 3"),
    (Step((row(tokens=(9, 9, 9), sat_slots=1, anchors=(1, 4)),)), "SAT anchors (1, 4)"),
    (Step((row(tokens=(9, 9, 9), anchors=(1,)),)), "SAT anchors without SAT slots"),
    (Step((row(tokens=(9, 9, 9), parents=(0, 3)),)), "a tree that is none (parents[1] = 3 "
                                                     "points at a later token"),
    (Step((row(tokens=(9, 9, 9), parents=(0,)),)), "a tree that is none (1 parents for 2"),
    (Step((row(tokens=(9, 9), sat_slots=1, parents=(0,)),)), "a tree with SAT slots"),
    (Step((row(),) * 5), "a step of 5 rows (at most 4)"),
    (Copy((4, 32), (5, 6)), "slot 32 in a Copy (the sessions' are 4..31)"),
    (Copy((4,), (3,)), "slot 3 in a Copy"),                        # the zero block's
    (Copy(tuple(range(4, 17)), tuple(range(17, 30))), "a Copy of 13 slots"),
    (WarmUp(HUGE, HUGE), "a warm-up for 1099511627776 rows of 1099511627776 tokens (this rank "
                         "serves 4 of 12)"),
    (WarmUp(4, 13), "a warm-up for 4 rows of 13 tokens"),
    (PoolSize("paged", 1 << 20, 4), "a second pool size"),
])
def test_a_message_past_a_following_ranks_own_pool_and_settings_is_refused(message, said):
    read = decode(*encode(message))         # well-formed: the layout alone lets it through
    with pytest.raises(OutOfBounds, match=re.escape(said)):
        check(read, LIMITS)


@pytest.mark.parametrize("message, said", [
    (PoolSize("paged", HUGE, 4), "a KV pool of 1099511627776 bytes (the ranks' free memory "
                                 "holds 1048576)"),
    (PoolSize("flex", 1 << 20, 4), "a flex engine (this rank's is paged)"),
    (PoolSize("paged", 1 << 20, 16), "blocks of 16 tokens (this rank's are 4)"),
    (Step(()), "a Step before the pool's size"),
    (WarmUp(4, 12), "a WarmUp before the pool's size"),
])
def test_the_first_message_must_be_a_pool_this_rank_would_make(message, said):
    with pytest.raises(OutOfBounds, match=re.escape(said)):
        check(decode(*encode(message)), SETTINGS)


@pytest.mark.parametrize("header, said", [
    (wire(STEP, length=LIMITS.max_values(Step) + 1)[0],
     f"a payload of {LIMITS.max_values(Step) + 1} values (a Step here has at most "
     f"{LIMITS.max_values(Step)})"),
    (wire(COPY, length=25)[0], "a payload of 25 values (a Copy here has at most 24)"),
    (wire(WARM_UP, length=3)[0], "(a WarmUp here has at most 2)"),
    (wire(POOL_SIZE, length=1 << 40)[0], "(a PoolSize here has at most 3)"),
    (wire(STOP, length=1)[0], "(a Stop here has at most 0)"),
    (wire(STEP, length=-1)[0], "a payload of -1 values"),
])
def test_a_payload_longer_than_its_kind_within_the_limits_is_refused_before_it_is_allotted(
        header, said):
    with pytest.raises(Unreadable, match=re.escape(said)):
        payload_length(header, LIMITS)


def test_a_pool_rank_0_sized_that_this_rank_cannot_make_ends_it_as_a_failed_step(monkeypatch):
    """make_engine's refusal (here: a pool of less than two blocks) is the rank abandoned (exit
    70, one line), not a traceback."""
    target = SimpleNamespace(model=make_model("llama", 64), device="cpu", vocab_size=64,
                             sat_slots=0, sat=None)
    ranks = SimpleNamespace(group=None, kv_budget=lambda device, fraction: 1 << 30)
    monkeypatch.setattr(follower, "receive", lambda channel, limits: PoolSize("paged", 10, 4))
    monkeypatch.setattr(follower, "abandon", lambda what: sys.exit(what))   # as its os._exit(70)
    with pytest.raises(SystemExit) as ended:
        follower.follow_leader(target, ranks, max_rows=4, max_step_tokens=12, block_tokens=4,
                               engine="paged")
    assert str(ended.value).startswith("the KV pool rank 0 sized could not be made here "
                                       "(ValueError: KV budget 10 bytes holds less than one block")


# A following rank over a real gloo group, with the limits above: rank 0's steps until Stop, with
# an engine that only says what it was told.
FOLLOWER = """
import sys
import torch.distributed as dist
import torch
from verify_server.engines.blocks import BlockPool, KVShape
from verify_server.engines.sharded import Channel, follow
from verify_server.engines.step_checks import Limits
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=1, world_size=2)
class Engine:
    pool = BlockPool(KVShape(1, 1, 4, torch.float32), num_blocks=8, block_tokens=4)
    def warm_up(self, max_rows, max_step_tokens):
        print("warmed up", max_rows, max_step_tokens, flush=True)
    def forward(self, rows):
        print("ran a step over slots", rows[0].kv.slots(0, 4).tolist(), flush=True)
follow(Engine(), Channel(None), Limits(4, 12, 4, "paged", 100, 2, 1 << 20, num_blocks=8))
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
# A rank 0 whose well-formed Step names a block 2**60 past the follower's pool (a session's KV
# elsewhere, once mirrored), then waits to be stopped
BLOCK_PAST_THE_POOL = """
import sys, time
import torch.distributed as dist
from verify_server.engines.sharded import Channel
from verify_server.engines.step_messages import RowPlan, Step
dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 2), rank=0, world_size=2)
Channel(None).send(Step((RowPlan(((1 << 60) + 5,), 0, (9,), True, 0, (), ()),)))
time.sleep(120)
"""


@pytest.mark.parametrize("leader, said", [
    (PICKLING_LEADER, "a message from rank 0 could not be read (a header of another layout"),
    (BLOCK_PAST_THE_POOL, "rank 0 sent what this rank cannot act on (row 0 of a step: block "
                          "1152921504606846981 in its table (the pool's are 1..7)); none of it "
                          "ran"),
], ids=["pickle", "block past the pool"])
def test_a_following_rank_sent_what_it_cannot_act_on_ends_and_nothing_of_it_runs(
        tmp_path, leader, said):
    marker, store = tmp_path / "ran", str(tmp_path / "store")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    leading = subprocess.Popen([sys.executable, "-c", leader, store, str(marker)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        following = subprocess.run([sys.executable, "-c", FOLLOWER, store], env=env,
                                   capture_output=True, text=True, timeout=120)
    finally:
        leading.kill()
        leading.wait()
    assert following.returncode == 70, following.stderr[-2000:]
    assert said in following.stderr
    assert "warmed up" not in following.stdout and "ran a step" not in following.stdout
    assert not marker.exists()


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
