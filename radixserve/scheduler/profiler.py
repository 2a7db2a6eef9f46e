"""/start_profile and /stop_profile: the torch profiler around the scheduler's forward steps.

A trace is a Chrome trace (JSON; open it in chrome://tracing or Perfetto) written when profiling
stops: on /stop_profile, or by itself after num_steps forward steps. With by_stage, prefill and
decode get a trace each (as SGLang's profile_by_stage): the prefill trace starts at the next prefill
batch and ends after num_steps of them, the decode trace likewise for decode steps.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

STAGES = ("prefill", "decode")


class ProfilerError(RuntimeError):
    """Profiling was asked to start twice, or to stop while not running."""


@dataclass
class _Recording:
    path: Path
    stage: str | None  # None: every step counts
    steps_left: int | None
    profile: Any = None  # torch.profiler.profile, once started


class StepProfiler:
    def __init__(self) -> None:
        self._recordings: list[_Recording] = []

    @property
    def active(self) -> bool:
        return bool(self._recordings)

    def start(self, output_dir: str | None, num_steps: int | None, by_stage: bool = False) -> dict[str, str]:
        """Starts recording; returns where the trace(s) will be written: {"trace": path}, or with
        by_stage {"prefill": path, "decode": path}."""
        if self._recordings:
            raise ProfilerError("the profiler is already running; stop it first")
        if num_steps is not None and num_steps < 1:
            raise ProfilerError("num_steps must be >= 1")
        if by_stage and num_steps is None:
            raise ProfilerError("profiling by stage needs num_steps (steps per stage)")
        directory = Path(output_dir or os.environ.get("RADIXSERVE_PROFILE_DIR", "/tmp"))
        directory.mkdir(parents=True, exist_ok=True)
        stem = f"radixserve-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if by_stage:
            self._recordings = [_Recording(directory / f"{stem}-{s}.json", s, num_steps) for s in STAGES]
            return {r.stage or "": str(r.path) for r in self._recordings}
        recording = _Recording(directory / f"{stem}.json", None, num_steps)
        recording.profile = _new_profile()
        self._recordings = [recording]
        return {"trace": str(recording.path)}

    def before_step(self, is_prefill: bool) -> None:
        stage = STAGES[0] if is_prefill else STAGES[1]
        for recording in self._recordings:
            # A stage's trace starts at its first step; only one stage records at a time, since
            # torch runs a single profiler per process.
            if recording.stage == stage and recording.profile is None and not self._recording_now():
                recording.profile = _new_profile()

    def after_step(self, is_prefill: bool) -> None:
        stage = STAGES[0] if is_prefill else STAGES[1]
        for recording in list(self._recordings):
            counts = recording.stage in (None, stage) and recording.profile is not None
            if counts and recording.steps_left is not None:
                recording.steps_left -= 1
                if recording.steps_left <= 0:
                    self._finish(recording)

    def stop(self) -> dict[str, str]:
        """Stops recording and writes what was recorded; returns the paths written."""
        if not self._recordings:
            raise ProfilerError("the profiler is not running")
        written = {}
        for recording in list(self._recordings):
            if recording.profile is not None:
                written[recording.stage or "trace"] = str(recording.path)
                self._finish(recording)
        self._recordings = []
        return written

    def _recording_now(self) -> bool:
        return any(r.profile is not None for r in self._recordings)

    def _finish(self, recording: _Recording) -> None:
        self._recordings.remove(recording)
        recording.profile.stop()
        recording.profile.export_chrome_trace(str(recording.path))


def _new_profile() -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profile = torch.profiler.profile(activities=activities, record_shapes=True)
    profile.start()
    return profile
