"""Link loss: netem drops packets; the user-space Link (lab.profiles.Link) delivers a lost
message one retransmission timeout late, as TCP under gRPC would, from a seeded stream."""
from __future__ import annotations

import dataclasses

import pytest

from lab.device_entry import netem_args
from lab.profiles import LINKS, Link, LinkProfile, link_profile


def test_every_link_profile_has_a_loss_figure_and_ethernet_loses_nothing():
    assert link_profile("ethernet").loss_pct == 0.0
    assert all(0.0 <= p.loss_pct <= 100.0 for p in LINKS.values())
    assert link_profile("wifi:loss_pct=3").loss_pct == 3.0
    with pytest.raises(ValueError, match="loss_pct"):
        LinkProfile("bad", 1.0, 0.0, 0.0, loss_pct=101.0)


def test_netem_gets_the_profiles_loss():
    argv = netem_args("wifi:loss_pct=2.5", "eth0")
    assert argv[argv.index("loss") + 1] == "2.5%"
    assert "loss" not in netem_args("ethernet", "eth0")


def arrivals(profile: LinkProfile, seed: int, n: int = 400) -> list[float]:
    """Each message's one-way time, sent far enough apart that no message queues behind one."""
    link = Link(profile, seed=seed)
    return [link.arrival("up", i * 10.0, 0) - i * 10.0 for i in range(n)]


def test_a_lost_message_waits_one_retransmission_timeout():
    far = LinkProfile("far", rtt_ms=150.0, jitter_ms=0.0, bandwidth_mbps=0.0, loss_pct=25.0)
    times = arrivals(far, seed=3)
    late = [t for t in times if t > 0.1]
    assert late and len(late) < len(times)                     # some lost, not all
    assert all(t == pytest.approx(0.075 + 0.3) for t in late)  # rtt/2 + max(0.2, 2 * rtt)
    near = dataclasses.replace(far, rtt_ms=10.0)
    assert max(arrivals(near, seed=3)) == pytest.approx(0.005 + 0.2)


def test_loss_is_seeded_and_leaves_the_jitter_draws_alone():
    lossy = LinkProfile("w", rtt_ms=6.0, jitter_ms=2.0, bandwidth_mbps=0.0, loss_pct=5.0)
    assert arrivals(lossy, seed=7) == arrivals(lossy, seed=7)
    assert arrivals(lossy, seed=7) != arrivals(lossy, seed=8)
    clean = dataclasses.replace(lossy, loss_pct=0.0)
    resend = lossy.retransmit_s()
    assert [t - resend if t > resend else t for t in arrivals(lossy, seed=7)] == \
        pytest.approx(arrivals(clean, seed=7))
