"""The step's skeleton and its components (scheduler/scheduler.py, scheduler/components.py): every
hook is called at its phase, in order, and a component's own pending work keeps the scheduler busy
and is what it sleeps on when nothing runs."""

from __future__ import annotations

from radixserve.protocol.messages import ReqOutput
from radixserve.scheduler.components import StepComponent
from radixserve.scheduler.state import ScheduledBatch
from tests.scheduler.fake_executor import Results, make_scheduler, run_until_idle, submit


class Recorder(StepComponent):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.work = 0  # steps of work of its own left
        self.waits = 0

    def receive(self) -> list[ReqOutput]:
        self.calls.append("receive")
        return []

    @property
    def pending(self) -> bool:
        return self.work > 0

    def wait(self, timeout_s: float) -> bool:
        if not self.work:
            return False
        self.work -= 1
        self.waits += 1
        return True

    def before_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.calls.append("before prefill" if is_prefill else "before decode")

    def after_forward(self, batch: ScheduledBatch | None, is_prefill: bool) -> None:
        self.calls.append("after")

    def after_results(self, batch: ScheduledBatch, is_prefill: bool, seconds: float) -> None:
        assert seconds >= 0
        self.calls.append("results")

    def end_step(self) -> None:
        self.calls.append("end")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_each_phase_calls_its_hooks_in_order() -> None:
    scheduler = make_scheduler(disable_overlap_schedule=True)
    recorder = Recorder()
    scheduler.components.append(recorder)
    results = Results()
    submit(scheduler, results, "a", [1, 2, 3], 2)
    results.take(scheduler.step())  # the prefill, and the first token
    results.take(scheduler.step())  # one decode step, the last token
    assert recorder.calls == [
        *("receive", "before prefill", "after", "results", "end"),
        *("receive", "before decode", "after", "results", "end"),
    ]
    assert len(results.tokens["a"]) == 2 and "a" in results.finish
    recorder.calls.clear()
    results.take(scheduler.step())  # nothing to run: idle
    assert recorder.calls == ["receive", "end"]
    scheduler.check_kv_invariant()
    scheduler.shutdown()
    assert recorder.calls[-1] == "shutdown"


def test_a_components_own_work_keeps_the_scheduler_busy_and_is_waited_on() -> None:
    scheduler = make_scheduler()
    recorder = Recorder()
    scheduler.components.append(recorder)
    recorder.work = 3
    assert not scheduler.is_idle
    results = Results()
    for _ in range(3):
        results.take(scheduler.step())
    # Each idle step slept on the work instead of spinning; the idle self-check waits for its end.
    assert recorder.waits == 3 and scheduler.is_idle
    run_until_idle(scheduler, results)
