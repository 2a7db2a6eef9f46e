"""/start_profile and /stop_profile: the torch profiler around the scheduler's forward steps.

The trace is a Chrome trace (JSON; open it in chrome://tracing or Perfetto) written when profiling
stops: on /stop_profile, or by itself after num_steps forward steps.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch


class ProfilerError(RuntimeError):
    """Profiling was asked to start twice, or to stop while not running."""


class StepProfiler:
    def __init__(self) -> None:
        self._profile: Any | None = None  # torch.profiler.profile
        self._path: Path | None = None
        self._steps_left: int | None = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self, output_dir: str | None, num_steps: int | None) -> str:
        """Starts recording; returns the path the trace will be written to."""
        if self._profile is not None:
            raise ProfilerError("the profiler is already running; stop it first")
        if num_steps is not None and num_steps < 1:
            raise ProfilerError("num_steps must be >= 1")
        directory = Path(output_dir or os.environ.get("RADIXSERVE_PROFILE_DIR", "/tmp"))
        directory.mkdir(parents=True, exist_ok=True)
        self._path = directory / f"radixserve-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.start()
        self._steps_left = num_steps
        return str(self._path)

    def after_step(self) -> None:
        if self._profile is None or self._steps_left is None:
            return
        self._steps_left -= 1
        if self._steps_left <= 0:
            self.stop()

    def stop(self) -> str:
        """Stops recording and writes the trace; returns its path."""
        if self._profile is None or self._path is None:
            raise ProfilerError("the profiler is not running")
        profile, path = self._profile, self._path
        self._profile = self._path = self._steps_left = None
        profile.stop()
        profile.export_chrome_trace(str(path))
        return str(path)
