"""What a device sends: the request that opens a session, and each round's draft."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from drafters.base import Proposal
from sled.wire.loose import Loose
from sled.wire.sampling import Sampling
from sled.v1 import verifier_pb2 as pb

DRAFTER_NAME_CHARS = 128     # the server refuses a longer Open.drafter


def drafter_label(name: str) -> str:
    """The drafter as the server sees it: a local file or folder by its own name, never the
    device's path (gguf:/home/pi/models/m.gguf -> gguf:m.gguf), within the server's limit."""
    kind, sep, arg = name.partition(":")
    if sep and arg and (Path(arg).is_absolute() or Path(arg).exists()):
        name = f"{kind}:{Path(arg).name}"
    return name[:DRAFTER_NAME_CHARS]


def open_message(request: SessionRequest, committed: Sequence[int] = ()) -> pb.DeviceMessage:
    """The Open of `request` for what is left after the committed tokens: the prompt and them,
    and max_new_tokens less them. request.cache_salt: the server shares cached prompt blocks
    only among sessions that send the same salt from the same host; request.loose: opt-in loose
    verification (not lossless)."""
    msg = pb.DeviceMessage(open=pb.Open(
        prompt_ids=list(request.prompt_ids) + list(committed),
        max_new_tokens=request.left(committed), stop_ids=list(request.stop_ids),
        tokenizer_fingerprint=request.fingerprint, drafter=drafter_label(request.drafter),
        ignore_eos=request.ignore_eos, mode=request.mode, cache_salt=request.cache_salt,
        movable=request.movable and request.mode == pb.GENERATION_MODE_DEVICE_DRAFTS))
    request.sampling.to_proto(msg.open.sampling)
    if request.loose is not None:
        request.loose.to_proto(msg.open.loose)
    return msg


def draft_message(round: int, proposal: Proposal, lookahead: int = 0) -> pb.DeviceMessage:
    """Round r's draft, with q per position in sampling mode, m SAT hints asked for, and its
    tree's parents when it branches."""
    q = [pb.SparseDistribution(ids=d.ids, probs=d.probs) for d in proposal.q or ()]
    return pb.DeviceMessage(draft=pb.Draft(round=round, token_ids=proposal.token_ids, q=q,
                                           lookahead=lookahead, parents=proposal.parents or ()))


@dataclass(frozen=True, slots=True)
class SessionRequest:
    """What a device session asks the server for; the same request reopens it after a loss."""
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_ids: Sequence[int] = ()
    ignore_eos: bool = False
    fingerprint: str = ""          # the drafter's tokenizer (or the target's when it has none)
    drafter: str = ""              # the drafter's name, for the server's logs and metrics
    cache_salt: str = ""           # prefix cache scope: shared with the same salt from this host
    mode: int = pb.GENERATION_MODE_DEVICE_DRAFTS   # who drafts: the device, or the server alone
    loose: Loose | None = None     # opt-in loose verification: the output is NOT the target's
    # the server may serve the session itself while it has room, and hand drafting back
    # (Open.movable): a device whose drafter keeps pace says so
    movable: bool = True

    def open_message(self, committed: Sequence[int]) -> pb.DeviceMessage:
        """Open (or reopen) the session for what is left after the committed tokens."""
        return open_message(self, committed)

    def left(self, committed: Sequence[int]) -> int:
        """Tokens the session may still emit after the committed ones."""
        return self.max_new_tokens - len(committed)
