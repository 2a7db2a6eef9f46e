"""The bootstrap fields sglang-router --pd-disaggregation adds: one set per prompt, checked."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.protocol.messages import BootstrapInfo
from radixserve.server.bootstrap_fields import ROOM_LIMIT, bootstrap_infos
from radixserve.server.errors import ApiError


def test_absent_fields_mean_no_disaggregation() -> None:
    assert bootstrap_infos(None, None, None, 3) == [None, None, None]


def test_one_set_per_prompt_and_the_default_port() -> None:
    assert bootstrap_infos("10.0.0.1", None, 7, 1) == [BootstrapInfo("10.0.0.1", 8998, 7)]
    infos = bootstrap_infos(["a", "b"], [9000, None], [1, 2], 2)
    assert infos == [BootstrapInfo("a", 9000, 1), BootstrapInfo("b", 8998, 2)]


@pytest.mark.parametrize(
    ("host", "port", "room", "count", "message"),
    [
        ("h", 1, None, 1, "go together"),
        (None, 1, 5, 1, "go together"),
        ("h", 1, 5, 2, "one bootstrap_room names one prompt"),
        ("h", 1, [5], 2, "one entry per prompt"),
        ("", 1, 5, 1, "bootstrap_host"),
        ("h", 70000, 5, 1, "bootstrap_port"),
        ("h", True, 5, 1, "bootstrap_port"),
        ("h", 1, -1, 1, "bootstrap_room"),
        ("h", 1, ROOM_LIMIT, 1, "bootstrap_room"),
        ("h", 1, "5", 1, "bootstrap_room"),
    ],
)
def test_bad_fields_are_a_400(host: Any, port: Any, room: Any, count: int, message: str) -> None:
    with pytest.raises(ApiError, match=message) as raised:
        bootstrap_infos(host, port, room, count)
    assert raised.value.status == 400


@given(st.integers(min_value=0, max_value=ROOM_LIMIT - 1), st.integers(min_value=1, max_value=65535))
def test_every_valid_room_and_port_is_kept_as_given(room: int, port: int) -> None:
    assert bootstrap_infos("127.0.0.1", port, room, 1) == [BootstrapInfo("127.0.0.1", port, room)]
