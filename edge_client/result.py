"""What a session produced: its tokens, why it ended, and what each round cost."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from sled import clock
from sled.v1 import verifier_pb2 as pb

FINISH_NAMES = {pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_STOP: "stop",
                pb.FINISH_REASON_LENGTH: "length"}
# How a session ends early on the device's side; its committed tokens are kept as partial output.
INTERRUPTED = "interrupted"      # the user stopped it (Ctrl-C)
SERVER_LOST = "server_lost"      # the server went away and none came back in time
SERVER_SILENT = "server_silent"  # the server went silent past its retries (ServerSilent)
SERVER_FAILED = "server_failed"  # ... or dropped the session without a verdict (ServerGivenUp)
# Where a verdict's tokens came from (Verdict.placement moves a movable session between them).
PLACEMENT_NAMES = {pb.GENERATION_MODE_DEVICE_DRAFTS: "device", pb.GENERATION_MODE_SERVER: "server",
                   pb.GENERATION_MODE_SERVER_SAT: "server_sat"}
# What a session tells about its server mid-session (ServerEvent.kind).
LOST = "lost"          # the server went away: the session waits for it or another
RESUMED = "resumed"    # a server took the session back where its committed tokens end


@dataclass(frozen=True, slots=True)
class RoundStat:
    draft_ms: float          # the device's turn: from the previous verdict to this draft sent
    round_trip_ms: float     # draft sent -> verdict received
    forward_ms: float        # the server's batched forward + acceptance
    queue_ms: float          # waiting on the server for a place in a forward
    verified: int            # draft tokens the server checked
    accepted: int            # ... and accepted
    suggested_draft_len: int = 0   # the server's advice, at most max_draft_len (0 = none)
    pipelined: int = 0             # draft tokens drafted while the previous verdict was in flight


@dataclass(frozen=True, slots=True)
class ServerEvent:
    """A session lost its server (LOST: it waits up to wait_s for it or another to take the
    session back) or got one back (RESUMED), after `committed` tokens."""
    kind: str                # LOST or RESUMED
    committed: int           # tokens committed so far (kept either way)
    wait_s: float            # how long the session waits for a server (its reconnect_s)
    detail: str = ""         # what the transport said (lost), how long it took (resumed)
    silent: bool = False     # LOST: the server sent no Opened or verdict in time (it went silent)


@dataclass(slots=True)
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    rounds: int = 0
    draft_tokens: int = 0          # draft tokens the server verified
    accepted_tokens: int = 0
    elapsed_s: float = 0.0
    server_forward_ms: float = 0.0
    resumes: int = 0               # sessions reopened after an eviction or a lost server
    hint_tokens: int = 0           # draft tokens that came from the server's SAT hints
    pipelined_tokens: int = 0      # draft tokens drafted ahead while a verdict was in flight
    text: str = ""
    loose: bool = False            # opened with loose verification: NOT the target's own output
    loose_accepted: int = 0        # draft tokens the server kept against the target's own token
    # tokens by where they came from ("device": its drafts verified; "server", "server_sat": the
    # server's own passes), and the times the server moved the session
    placements: dict[str, int] = field(default_factory=dict)
    moves: int = 0
    round_stats: list[RoundStat] = field(default_factory=list)
    # (verified, accepted) of every verdict, device drafts or the server's SAT guesses alike
    judged: list[tuple[int, int]] = field(default_factory=list)
    # perf_counter seconds since the session started at which each token arrived (one stamp per
    # token; the tokens of one verdict share it)
    token_times: list[float] = field(default_factory=list)

    def add(self, verdict: pb.Verdict, started: float,
            placement: int = pb.GENERATION_MODE_DEVICE_DRAFTS) -> bool:
        """Count one verdict's tokens and stats (arrival stamped against `started`, a
        clock.now() time; `placement`: where they came from); True when the verdict ends the
        session."""
        self.rounds += 1
        name = PLACEMENT_NAMES[placement]
        self.placements[name] = self.placements.get(name, 0) + len(verdict.emitted_ids)
        self.server_forward_ms += verdict.timings.forward_ms
        self.draft_tokens += verdict.verified        # device drafts, or the server's SAT guesses
        self.accepted_tokens += verdict.accepted
        self.loose_accepted += verdict.loose_accepted
        self.judged.append((verdict.verified, verdict.accepted))
        self.token_ids.extend(verdict.emitted_ids)
        self.token_times.extend([clock.now() - started] * len(verdict.emitted_ids))
        if verdict.finish_reason == pb.FINISH_REASON_UNSPECIFIED:
            return False
        self.finish_reason = FINISH_NAMES[verdict.finish_reason]
        return True

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return len(self.token_ids) / self.rounds if self.rounds else 0.0

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("round_stats")
        out.pop("token_times")
        out.pop("judged")
        out.update(verification="loose (not lossless)" if self.loose else "lossless",
                   acceptance_rate=round(self.acceptance_rate, 4),
                   tokens_per_round=round(self.tokens_per_round, 4),
                   tokens_per_s=round(len(self.token_ids) / self.elapsed_s, 2) if self.elapsed_s else 0.0)
        return out
