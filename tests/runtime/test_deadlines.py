"""RequestDeadlines: which requests outlived --request-timeout, each reported once."""

from __future__ import annotations

from radixserve.runtime.deadlines import RequestDeadlines


def test_late_requests_are_reported_once_and_finished_ones_never() -> None:
    deadlines = RequestDeadlines(2.0)
    deadlines.start("a", now=0.0)
    deadlines.start("b", now=1.0)
    deadlines.start("c", now=1.5)
    deadlines.done("b")
    assert deadlines.expired(1.9) == []
    assert deadlines.expired(3.2) == ["a"]
    assert deadlines.expired(3.2) == []
    assert len(deadlines) == 1
    assert deadlines.expired(10.0) == ["c"]
    assert not deadlines


def test_a_reused_rid_counts_from_its_new_start() -> None:
    deadlines = RequestDeadlines(2.0)
    deadlines.start("a", now=0.0)
    deadlines.done("a")
    deadlines.start("a", now=5.0)
    assert deadlines.expired(3.0) == []
    assert deadlines.expired(7.0) == ["a"]


def test_no_timeout_tracks_nothing() -> None:
    deadlines = RequestDeadlines(None)
    deadlines.start("a", now=0.0)
    assert not deadlines and deadlines.expired(1e9) == []
