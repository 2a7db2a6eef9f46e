"""Property tests of the protocol types: arbitrary input is refused with InvalidRequestError (or
BadJsonValue), never with another exception."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixserve.protocol.sampling_params import InvalidRequestError, SamplingParams
from radixserve.server.json_values import INT_MAX, INT_MIN, BadJsonValue, check_value

SETTINGS = settings(
    max_examples=400, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=INT_MIN, max_value=INT_MAX),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=10),
)
JSON = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=10,
)
# Mostly the real field names, so that validation (not the unknown-name check) is what gets exercised.
PARAMS = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6) | st.dictionaries(
    st.sampled_from(FIELDS) | st.text(max_size=6), JSON, max_size=4
)


# from_dict checks JSON types before it compares values ({"temperature": None} once raised TypeError),
# so a caller of the Engine API gets an InvalidRequestError, as an HTTP client gets a 400.
@settings(SETTINGS, report_multiple_bugs=False)
@given(params=PARAMS)
def test_sampling_params_from_dict_refuses_cleanly(params: dict[str, Any]) -> None:
    try:
        sp = SamplingParams.from_dict(params)
    except InvalidRequestError:
        return
    # What it accepts is well-typed.
    assert isinstance(sp.max_new_tokens, int) and sp.max_new_tokens >= 0
    assert all(isinstance(s, str) and s for s in sp.stop)
    assert math.isfinite(sp.temperature) and sp.temperature >= 0
    sp.check_vocab(32000)


# JSON-like values, including what json.loads accepts but nothing downstream can hold.
HOSTILE_SCALARS = st.one_of(
    SCALARS,
    st.integers(),
    st.floats(),
    st.text(alphabet=st.characters(codec=None, min_codepoint=0xD7F0, max_codepoint=0xE010), max_size=3),
)
HOSTILE = st.recursive(
    HOSTILE_SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(max_size=4) | HOSTILE_SCALARS.filter(lambda x: isinstance(x, str)), children, max_size=4
        )
    ),
    max_leaves=12,
)


def _holdable(value: Any) -> bool:
    if isinstance(value, str):
        return not any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return INT_MIN <= value <= INT_MAX
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_holdable(k) and _holdable(v) for k, v in value.items())
    return all(_holdable(v) for v in value)


@SETTINGS
@given(value=HOSTILE)
def test_check_value_refuses_exactly_what_cannot_be_held(value: Any) -> None:
    try:
        check_value(value)
    except BadJsonValue as bad:
        assert not _holdable(value)
        assert str(bad)
        return
    assert _holdable(value)
