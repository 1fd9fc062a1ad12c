"""The end of a round, the same for every mode: commit, count, answer.

    outcome, info = await scheduler.verify(session, draft, q, deadline)   # decide (engine thread)
    verdict = finish_round(session, outcome, len(draft), info, metrics)    # commit, count, say

A device that drafts the next round hears more from its round's verdict (the core adds it): the
draft length to send next, and the SAT hints to start it with.
"""
from __future__ import annotations

from sled.v1 import verifier_pb2 as pb
from verify_server.acceptance import Outcome
from verify_server.metrics import Metrics
from verify_server.scheduler import StepInfo
from verify_server.session import Session


def finish_round(session: Session, outcome: Outcome, draft_len: int, info: StepInfo,
                 metrics: Metrics) -> pb.Verdict:
    """Commit the round's outcome to the session (its tokens and their KV), count it, and say it.

    draft_len: the draft tokens verified. The verdict carries no SAT hints (server modes use them
    themselves) and suggests no draft length."""
    emitted, finish, accepted = session.commit(outcome)
    session.observe(draft_len, accepted)
    loose = sum(1 for j in outcome.loose_at if j < accepted)   # those the output kept
    metrics.count_round(draft_len, accepted, len(emitted), loose)
    return pb.Verdict(round=session.round - 1, accepted=accepted, emitted_ids=emitted,
                      finish_reason=finish, timings=timings(info), verified=draft_len,
                      loose_accepted=loose)


def timings(info: StepInfo) -> pb.ServerTimings:
    return pb.ServerTimings(queue_ms=info.queue_ms, forward_ms=info.forward_ms,
                            batch_size=info.batch_size)
