"""The end of a round, the same for every mode: commit, count, answer.

    outcome, info = await scheduler.verify(session, draft, q, deadline)   # decide (engine thread)
    verdict = finish_round(session, outcome, len(draft), info, metrics)    # commit, count, say
"""
from __future__ import annotations

from collections.abc import Callable

from sled.v1 import verifier_pb2 as pb
from verify_server.acceptance import Outcome
from verify_server.metrics import Metrics
from verify_server.scheduler import StepInfo
from verify_server.session import Session


def finish_round(session: Session, outcome: Outcome, draft_len: int, info: StepInfo,
                 metrics: Metrics, advise: Callable[[Session], int] | None = None) -> pb.Verdict:
    """Commit the round's outcome to the session (its tokens and their KV), count it, and say it.

    draft_len: the draft tokens verified. `advise` is given when a device drafts the next round:
    the verdict then suggests its next draft length and carries the SAT hints to start it with
    (server modes use the hints themselves)."""
    emitted, finish, accepted = session.commit(outcome)
    session.observe(draft_len, accepted)
    loose = sum(1 for j in outcome.loose_at if j < accepted)   # those the output kept
    metrics.count_round(draft_len, accepted, len(emitted), loose)
    verdict = pb.Verdict(round=session.round - 1, accepted=accepted, emitted_ids=emitted,
                         finish_reason=finish, timings=timings(info), verified=draft_len,
                         loose_accepted=loose)
    if advise is not None:
        verdict.suggested_draft_len = advise(session)
        if not session.finished:
            verdict.hint_ids.extend(outcome.hints)
    return verdict


def timings(info: StepInfo) -> pb.ServerTimings:
    return pb.ServerTimings(queue_ms=info.queue_ms, forward_ms=info.forward_ms,
                            batch_size=info.batch_size)
