"""How the course's torch processes wait for work on the CPU, so that two of them can share a small machine.

Torch runs CPU operations on OpenMP threads, one per core (`utils.models.set_cpu_threads`). Between two operations
GNU OpenMP's threads keep spinning for a while before they sleep, to start the next one sooner. Alone, that saves a
little. But a learner on a 2-core laptop often runs two course processes at once (a notebook kernel, and the tests or
a script in a terminal): then each process's spinning threads hold the cores the other one's working threads need,
and both crawl. `python bench/side_by_side.py` measures it; its figures are in docs/learners.md ("Side by side").

The course therefore tells OpenMP to spin only briefly (WAIT_POLICY). OpenMP reads this once, when torch loads it, so
it must be in the environment before `import torch`: importing `utils` or `solutions` sets it, `conftest.py` imports
`utils` before torch, and the notebooks' setup cell imports the course before torch. A value you set yourself (in
the environment, before starting Python) is kept.
"""

from __future__ import annotations

import os
import sys

# GNU OpenMP spins this many times before a waiting thread sleeps (its default is 300,000). Measured on 2 cores with
# bench/side_by_side.py (a worker's time side by side / its time alone; alone, against the default's): 300,000:
# 6x; 10,000: 2.9x; 3,000: 2.1x; 1,000: 1.6-1.7x, alone 1.3x slower; 100: 1.5x, alone 1.4x slower; no spinning at
# all (OMP_WAIT_POLICY=PASSIVE): 3.0x, since every wake-up then goes through the kernel. 1,000 is the largest count
# that keeps two processes within their fair share (2x).
WAIT_POLICY = {"GOMP_SPINCOUNT": "1000"}


def apply_wait_policy() -> bool:
    """Put the course's OpenMP wait policy in the environment, keeping any value already there. Returns whether it
    can take effect in this process (torch not loaded yet); child processes inherit it either way."""
    for name, value in WAIT_POLICY.items():
        os.environ.setdefault(name, value)
    return "torch" not in sys.modules
