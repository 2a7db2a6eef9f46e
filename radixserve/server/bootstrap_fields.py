"""The bootstrap fields sglang-router --pd-disaggregation adds to every request it forwards:
bootstrap_host, bootstrap_port and bootstrap_room, once for the request or once per prompt."""

from __future__ import annotations

from typing import Any

from radixserve.config.disaggregation_args import DEFAULT_BOOTSTRAP_PORT
from radixserve.protocol.messages import BootstrapInfo
from radixserve.server.errors import ApiError
from radixserve.server.limits import per_prompt

ROOM_LIMIT = 2**63  # sglang-router draws rooms below it; JSON integers here are 64-bit signed


def bootstrap_infos(host: Any, port: Any, room: Any, count: int) -> list[BootstrapInfo | None]:
    """One BootstrapInfo per prompt (None for all when the fields are absent). A port of None is
    the prefill server's default bootstrap port, as in SGLang."""
    if host is None and room is None:
        return [None] * count
    if host is None or room is None:
        raise ApiError(400, "bootstrap_host and bootstrap_room go together", param="bootstrap_room")
    if count > 1 and not isinstance(room, list):
        raise ApiError(
            400, "one bootstrap_room names one prompt and one choice: give a list, one per prompt",
            param="bootstrap_room",
        )  # fmt: skip
    infos: list[BootstrapInfo | None] = []
    for h, p, r in zip(per_prompt(host, count, "bootstrap_host"), per_prompt(port, count, "bootstrap_port"),
                       per_prompt(room, count, "bootstrap_room"), strict=True):  # fmt: skip
        if not isinstance(h, str) or not h:
            raise ApiError(400, "bootstrap_host must be a host name or address", param="bootstrap_host")
        if p is None:
            p = DEFAULT_BOOTSTRAP_PORT
        if not isinstance(p, int) or isinstance(p, bool) or not 0 < p < 65536:
            raise ApiError(400, "bootstrap_port must be a port number", param="bootstrap_port")
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < ROOM_LIMIT:
            raise ApiError(400, "bootstrap_room must be an integer in [0, 2**63)", param="bootstrap_room")
        infos.append(BootstrapInfo(h, p, r))
    return infos
