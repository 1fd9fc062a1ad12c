"""The processes of one server split over N GPUs (sled serve --tp N), on torch.distributed.

Started the way PyTorch programs are: under `torchrun --nproc-per-node N` every process is
started by torchrun and reads its rank from the environment; run plainly, `sled serve --tp N`
is rank 0 and starts ranks 1..N-1 itself, as children in a session of their own (Ctrl-C reaches
rank 0 alone, which stops them) that die with it. Rank r uses GPU r of the machine (cuda:r,
after CUDA_VISIBLE_DEVICES); the model's collectives go over NCCL on GPUs, gloo on a CPU; rank
0's step messages (engines.sharded) over a gloo group of their own. Where they meet, and on
which network they talk, is verify_server.rendezvous's to say.

A split server whose ranks no longer agree cannot serve: a step that fails on one rank leaves
the others waiting in a collective. Such a failure ends the process (`abandon`), its ranks go
with it (a child of rank 0 dies with it; the others' collectives fail or time out after
COLLECTIVE_WAIT), and whatever supervises the server starts it again.

    ranks = start_ranks(2, "cuda", ["serve", "--model", "...", "--tp", "2"])
    ranks.rank, ranks.device       # 0, "cuda:0" in the server; 1, "cuda:1" in its child
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from sled.models import resolve_model
from verify_server.engines import free_memory_bytes
from verify_server.rendezvous import STORE_KEY, Meeting, warn_open_network
from verify_server.target import check_splittable

log = logging.getLogger("sled.server.ranks")

PR_SET_PDEATHSIG = 1
PARENT_KEY = "SLED_RANK_PARENT"       # in a child rank's environment: rank 0's pid
# Rank 0 may stay idle for days between steps: its followers wait for the next message that long
# (a rank 0 that dies closes the connection, which ends the wait at once).
IDLE_WAIT = timedelta(days=365)
# A collective inside a step: every rank enters it within this, or the step has failed somewhere
COLLECTIVE_WAIT = timedelta(minutes=10)
ABANDONED = 70                        # the exit status of a rank that gave up (EX_SOFTWARE)


@dataclass(slots=True)
class Ranks:
    rank: int
    size: int
    device: str                  # this rank's torch device
    children: tuple[subprocess.Popen, ...] = ()   # the ranks rank 0 started itself
    group: object = None         # the gloo group of rank 0's step messages
    meeting: Meeting | None = None   # where ranks on one machine meet (None: torchrun's store)

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def kv_budget(self, device: str, fraction: float) -> int:
        """The whole server's KV bytes when none is given: `fraction` of the least free memory
        of the ranks' GPUs, on each of them (of the one memory a CPU's ranks share). A
        collective: every rank calls it, once, before rank 0 makes its engine. Every rank has
        loaded its shard and made its groups by then: the ranks have met, their store goes."""
        free = torch.tensor([free_memory_bytes(torch.device(device))], dtype=torch.int64)
        dist.all_reduce(free, op=dist.ReduceOp.MIN, group=self.group)
        if self.meeting is not None:
            self.meeting.close()
        return int(int(free) * fraction * (self.size if device.startswith("cuda") else 1))

    def end(self, timeout_s: float = 10.0) -> None:
        """As this rank ends: the children it started exit (at once once it said Stop; killed
        past `timeout_s`, e.g. when rank 0 failed before its engine was made), then the group,
        and the ranks' store if they never met."""
        for child in self.children:
            try:
                child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.meeting is not None:
            self.meeting.close()


def abandon(what: str) -> NoReturn:
    """A step failed on this rank after the ranks began it: they may no longer agree on what
    comes next, so this process ends now (its children with it)."""
    log.critical("%s on rank %d of a split server: its ranks may no longer agree, so this "
                 "process ends (exit %d); restart the server", what,
                 dist.get_rank() if dist.is_initialized() else 0, ABANDONED)
    logging.shutdown()
    os._exit(ABANDONED)


def split(settings, argv: list[str]) -> Ranks | None:
    """sled serve's rank when its settings ask for --tp N > 1 (None for --tp 1): rank 0 run
    plainly starts the others with `argv`. ValueError (one line) for a model that does not
    split over N ranks, asked before any rank starts."""
    started = int(os.environ.get("WORLD_SIZE", "1"))     # by torchrun
    if settings.tp == 1 and started == 1:
        return None
    if "WORLD_SIZE" in os.environ and started != settings.tp:
        raise ValueError(f"torchrun started {started} processes for --tp {settings.tp}: give "
                         f"torchrun --nproc-per-node {settings.tp}, or sled serve --tp {started}")
    check_splittable(resolve_model(settings.model), settings.tp, settings.trust_remote_code,
                     settings.model)
    return start_ranks(settings.tp, settings.device, argv)


def start_ranks(tp: int, device: str, argv: list[str]) -> Ranks:
    """This process's rank of a server over `tp` ranks, the process group joined; rank 0 run
    plainly starts the others with `argv` (sled's own arguments) first."""
    _check_devices(tp, device)
    children, meeting = (), None
    if PARENT_KEY in os.environ:
        _follow_parent(int(os.environ[PARENT_KEY]))
        meeting = Meeting.joined(os.environ[STORE_KEY])
    elif "WORLD_SIZE" not in os.environ:
        meeting = Meeting.open()
        children = _start_children(tp, argv, meeting)
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if meeting is None and rank == 0:
        warn_open_network()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
    _join(size, rank, torch.device("cuda", local) if cuda else None, meeting)
    group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
    return Ranks(rank, size, f"cuda:{local}" if cuda else device, children, group, meeting)


def _join(size: int, rank: int, gpu: torch.device | None, meeting: Meeting | None) -> None:
    """The process group: NCCL's communicator made now on a GPU (the ranks meet once, at start),
    gloo on a CPU; through `meeting`'s store, else torchrun's (env://)."""
    backend = "nccl" if gpu is not None else "gloo"
    if meeting is None:
        dist.init_process_group(backend, timeout=COLLECTIVE_WAIT, device_id=gpu)
    else:
        dist.init_process_group(backend, timeout=COLLECTIVE_WAIT, device_id=gpu,
                                store=meeting.store(size), rank=rank, world_size=size)


def _check_devices(tp: int, device: str) -> None:
    """ValueError (one line, said once: before any child starts) unless this machine has what
    the ranks need."""
    gpus = torch.cuda.device_count()
    if device.startswith("cuda"):
        wanted = int(os.environ.get("LOCAL_WORLD_SIZE", tp))
        if gpus < wanted:
            raise ValueError(f"--tp {tp} needs {wanted} GPUs on this machine; it shows {gpus}")
    elif gpus:     # transformers puts a split model on the machine's accelerator
        raise ValueError(f"--tp {tp} --device {device} on a machine with GPUs would split the "
                         "model over them: give --device cuda, or hide them with "
                         "CUDA_VISIBLE_DEVICES=")


def _start_children(tp: int, argv: list[str], meeting: Meeting) -> tuple[subprocess.Popen, ...]:
    """Ranks 1..tp-1 of this machine, each `sled` with `argv`, the ranks' variables torchrun
    would give it and `meeting`'s (where they meet); this process becomes rank 0."""
    common = {"WORLD_SIZE": str(tp), "LOCAL_WORLD_SIZE": str(tp), **meeting.environment()}
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    children = []
    for rank in range(1, tp):
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank),
               PARENT_KEY: str(os.getpid())}
        children.append(subprocess.Popen(
            [sys.executable, "-c", "import sys; from sled_cli.main import main; sys.exit(main())",
             *argv], env=env, start_new_session=True))
    return tuple(children)


def _follow_parent(parent: int) -> None:
    """In a child rank: killed when rank 0 is gone (Linux), at once if it already is."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(ABANDONED)

