"""How steady this host's speed is: a fixed matmul's rate, second after second, with the CPU time
the hypervisor took (steal) in each second.

    python benchmarks/host_speed.py [--seconds 300] [--out bench-work/host-speed.json]

Why: a simulator validation compares predictions with runs timed minutes apart, and on a shared
host those runs meet different spells of speed. On a 2-core Zen 3 the matmul rate
jumped between about 90 and 160 GFLOP/s for seconds to tens of seconds at a time, with no
steal at all (docs/simulator.md, "Validation"): the other tenants of the same cores or caches, which
no reading inside the VM shows. Run it before a validation to see whether the host is quiet, or
beside the validation's figures to judge its misses. It prints the rates' spread, the share of
seconds in fast and slow spells (above 1.2 times the median, or below it over 1.2), and how long
those spells lasted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from radixserve_tools.simulator.peaks import measure_flops

# A spell is fast (or slow) when its rate is this far above (or below) the median's.
SPELL_RATIO = 1.2


def _steal_ticks() -> int:
    """The CPU time the hypervisor has taken from this machine so far, in clock ticks (Linux
    /proc/stat: the eighth figure of its first line)."""
    with open("/proc/stat") as stat:
        return int(stat.readline().split()[8])


def spells(flags: list[bool]) -> list[int]:
    """The lengths of the runs of True in `flags`."""
    lengths, current = [], 0
    for flag in [*flags, False]:
        if flag:
            current += 1
        elif current:
            lengths.append(current)
            current = 0
    return lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("bench-work/host-speed.json"))
    args = parser.parse_args()
    rates, steals = [], []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        before = _steal_ticks()
        # fp32 on every CPU: a speed index of the host, not a rate of the engine's own kernels.
        rates.append(measure_flops(seconds=1.0, dtype=torch.float32) / 1e9)
        steals.append(_steal_ticks() - before)
    middle = statistics.median(rates)
    fast = spells([rate > SPELL_RATIO * middle for rate in rates])
    slow = spells([rate < middle / SPELL_RATIO for rate in rates])
    spread = f"{min(rates):.0f} / {middle:.0f} / {max(rates):.0f}"
    print(f"{len(rates)} seconds: {spread} GFLOP/s (least / median / most)")
    for name, found in (("fast", fast), ("slow", slow)):
        print(f"{name} spells: {sum(found)} s in {len(found)}, the longest {max(found, default=0)} s")
    print(f"steal: {sum(steals)} ticks over the cores, of {len(rates) * os.sysconf('SC_CLK_TCK')} a core")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gflops": rates, "steal_ticks": steals}) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
