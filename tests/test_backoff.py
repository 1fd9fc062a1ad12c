"""sled's one backoff (sled.backoff): the delays each of its retry loops waits."""
import random

from sled.backoff import Backoff, broker_backoff


def test_delays_grow_by_the_factor_up_to_the_most_and_start_again_on_reset():
    pauses = Backoff(0.05, most=2.0)
    assert [pauses.next() for _ in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    pauses.reset()
    assert pauses.current == 0.05 and pauses.next() == 0.05


def test_without_jitter_the_delays_leave_the_random_stream_alone():
    random.seed(7)
    expected = random.random()
    random.seed(7)
    Backoff(0.5).next()
    assert random.random() == expected


def test_the_broker_backoff_jitters_and_waits_long_after_refused_credentials():
    backoff = broker_backoff()
    delays = [backoff.next() for _ in range(10)]
    assert 0.4 <= delays[0] <= 0.6 and 0.8 <= delays[1] <= 1.2
    assert all(24.0 <= d <= 36.0 for d in delays[7:])      # capped at 30 s, within 20%
    backoff.reset()
    assert backoff.next(refused=True) == 30.0
