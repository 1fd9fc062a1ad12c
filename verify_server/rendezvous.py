"""Where the ranks of a split server meet (sled serve --tp N).

Run plainly, every rank is on this machine, and they meet where only the server's own processes
can: a torch.distributed FileStore in a folder of rank 0's that only its user can open (0700),
its path given to the children in their environment, and gloo's and NCCL's sockets on loopback.
The store keeps everyone else out of the meeting: no other host, and no other user of this
machine, can join the ranks or pose as one of them. Rank 0 removes the folder once the ranks
have met, or as it exits before (a rank 0 killed before leaves it behind: a file in a private
folder). gloo's listeners and NCCL's bootstrap stay open on loopback for the server's life (the
model's collectives need them): a local user of the machine can reach them, not to join the
ranks but to disrupt them, so a split server belongs on a machine without untrusted users, or
in a network namespace of its own (docs/security.md).

    meeting = Meeting.open()              # rank 0, before it starts the children
    env = {**os.environ, **meeting.environment()}
    store = meeting.store(2)              # in rank 0; a child: Meeting.joined(...).store(2)

Under torchrun the ranks meet on torchrun's TCP store (MASTER_ADDR:MASTER_PORT), which anyone
who reaches that address can join: `warn_open_network` says so, and what the network must hold.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch.distributed as dist

log = logging.getLogger("sled.server.ranks")

STORE_KEY = "SLED_RANK_STORE"     # in a child rank's environment: the store's file
# The ranks' own connections on loopback: gloo's (the CPU collectives and the step messages)
# and NCCL's bootstrap (its data goes GPU to GPU within the machine)
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


class Meeting:
    """The store of ranks on one machine: a file in a folder only this user can open. Rank 0
    owns the folder (removes it once, at `close` or as it exits); a child only joins."""

    def __init__(self, path: Path, owned: bool) -> None:
        self.path = path
        self._remove = weakref.finalize(self, shutil.rmtree, path.parent, ignore_errors=True) \
            if owned else None

    @classmethod
    def open(cls) -> "Meeting":
        """Rank 0's: a new private folder (mkdtemp makes it 0700) for the store's file."""
        return cls(Path(tempfile.mkdtemp(prefix="sled-ranks-")) / "store", owned=True)

    @classmethod
    def joined(cls, path: str) -> "Meeting":
        return cls(Path(path), owned=False)

    def environment(self) -> dict[str, str]:
        """What a child rank needs to meet the others here, and only here."""
        return {STORE_KEY: str(self.path), **LOOPBACK}

    def store(self, size: int) -> dist.FileStore:
        return dist.FileStore(str(self.path), size)

    def close(self) -> None:
        """Once every rank has made every group it needs: the store is of no more use."""
        if self._remove is not None:
            self._remove()


def warn_open_network() -> None:
    """Under torchrun: the start-up line that names where the ranks meet, and what must hold."""
    log.warning("the ranks meet on torchrun's store at %s:%s and talk on the interfaces "
                "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME name (else the host name's): anyone "
                "who reaches them can join the ranks or pose as one, so keep them on a network "
                "only the ranks reach (docs/server.md, 'Bigger than one GPU')",
                os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?"))
