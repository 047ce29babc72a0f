"""Running async code from plain functions, in scripts and in notebooks alike."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


def run_sync(coroutine):
    """Run `coroutine` to completion and return its result.

    `asyncio.run` refuses to start inside an already running event loop, which is where a Jupyter cell runs; there
    the coroutine gets a fresh loop in a worker thread instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
