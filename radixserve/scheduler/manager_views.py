"""The scheduler's own names for state its managers keep.

The queues and the batch budgets live in RequestQueues (state.py), PrefillManager (prefill.py) and
DecodeManager (decode.py); control commands, the watchdog and tests read and set them through the
scheduler under these names.
"""

from __future__ import annotations

from radixserve.scheduler.decode import DecodeManager
from radixserve.scheduler.prefill import PrefillManager
from radixserve.scheduler.request import Req
from radixserve.scheduler.state import RequestQueues


class ManagerViews:
    queues: RequestQueues
    prefill: PrefillManager
    decode: DecodeManager

    @property
    def waiting(self) -> list[Req]:
        return self.queues.waiting

    @waiting.setter
    def waiting(self, reqs: list[Req]) -> None:
        self.queues.waiting = reqs

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @running.setter
    def running(self, reqs: list[Req]) -> None:
        self.queues.running = reqs

    @property
    def chunked_req(self) -> Req | None:
        return self.queues.chunked_req

    @chunked_req.setter
    def chunked_req(self, req: Req | None) -> None:
        self.queues.chunked_req = req

    @property
    def max_running(self) -> int:
        return self.prefill.max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        self.prefill.max_running = value

    @property
    def new_token_ratio(self) -> float:
        return self.decode.new_token_ratio

    @new_token_ratio.setter
    def new_token_ratio(self, value: float) -> None:
        self.decode.new_token_ratio = value

    @property
    def init_new_token_ratio(self) -> float:
        return self.decode.init_new_token_ratio

    @property
    def min_new_token_ratio(self) -> float:
        return self.decode.min_new_token_ratio

    @property
    def new_token_ratio_decay(self) -> float:
        return self.decode.new_token_ratio_decay

    def reset_new_token_ratio(self) -> None:
        self.decode.reset_new_token_ratio()
