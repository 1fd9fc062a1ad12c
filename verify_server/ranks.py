"""The processes of one server split over N GPUs (sled serve --tp N), on torch.distributed.

Started the way PyTorch programs are: under `torchrun --nproc-per-node N` every process is
started by torchrun and reads its rank from the environment; run plainly, `sled serve --tp N`
is rank 0 and starts ranks 1..N-1 itself, as children that die with it. Rank r uses GPU r of
the machine (cuda:r, after CUDA_VISIBLE_DEVICES); the model's collectives go over NCCL on GPUs,
gloo on a CPU; rank 0's step messages (engines.sharded) over a gloo group of their own.

    ranks = start_ranks(2, "cuda", ["serve", "--model", "...", "--tp", "2"])
    ranks.rank, ranks.device       # 0, "cuda:0" in the server; 1, "cuda:1" in its child
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from sled.models import resolve_model
from verify_server.target import check_splittable

TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
PR_SET_PDEATHSIG = 1
# Rank 0 may stay idle for days between steps: its followers wait for the next message that long
# (a rank 0 that dies closes the connection, which ends the wait at once).
IDLE_WAIT = timedelta(days=365)


@dataclass(slots=True)
class Ranks:
    rank: int
    size: int
    device: str                  # this rank's torch device
    children: tuple[subprocess.Popen, ...] = ()   # the ranks rank 0 started itself
    group: object = None         # the gloo group of rank 0's step messages

    @property
    def leads(self) -> bool:
        return self.rank == 0

    def wait_children(self, timeout_s: float = 5.0) -> None:
        """As rank 0 ends: the children it started exit (they do at once once it said Stop;
        killed past `timeout_s`, e.g. when rank 0 failed before its engine was made)."""
        for child in self.children:
            try:
                child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()


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
    children = ()
    if "WORLD_SIZE" not in os.environ:
        children = _start_children(tp, argv)
    size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    cuda = device.startswith("cuda")
    if cuda:
        if torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", size)):
            raise ValueError(f"--tp {tp} needs {tp} GPUs; this machine shows "
                             f"{torch.cuda.device_count()}")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
    return Ranks(rank, size, f"cuda:{local}" if cuda else device, children, group)


def _start_children(tp: int, argv: list[str]) -> tuple[subprocess.Popen, ...]:
    """Ranks 1..tp-1 of this machine, each `sled` with `argv` and the environment torchrun
    would give it; this process becomes rank 0."""
    port = _free_port()
    common = {"WORLD_SIZE": str(tp), "LOCAL_WORLD_SIZE": str(tp), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)}
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    children = []
    for rank in range(1, tp):
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        children.append(subprocess.Popen(
            [sys.executable, "-c", "import sys; from sled_cli.main import main; sys.exit(main())",
             *argv], env=env, preexec_fn=_die_with_parent))
    return tuple(children)


def _die_with_parent() -> None:
    """In a child rank before it runs: SIGKILL when rank 0 is gone (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
