"""The worker pool: deadlines kill and replace workers, crashes are contained, errors keep their status."""

import asyncio
import math
import os
import time

import pytest

from m3stack.gateway.multimodal import MediaError
from m3stack.gateway.multimodal.fetch import decode_data_url
from m3stack.gateway.multimodal.pool import WorkerPool


def test_pool_survives_timeouts_crashes_and_errors():
    async def scenario() -> None:
        pool = WorkerPool(workers=1)
        await pool.start()
        try:
            assert await pool.run(math.hypot, 3, 4, timeout_s=30) == 5.0

            started = time.monotonic()
            with pytest.raises(MediaError, match=r"longer than 0\.5s") as timeout:
                await pool.run(time.sleep, 30, timeout_s=0.5)
            assert timeout.value.code == "media_timeout" and time.monotonic() - started < 10

            with pytest.raises(MediaError, match="crashed its decoder"):
                await pool.run(os._exit, 3, timeout_s=30)

            with pytest.raises(MediaError, match="needs a comma") as media:
                await pool.run(decode_data_url, "data:broken", 10, timeout_s=30)
            assert media.value.status == 400

            with pytest.raises(MediaError, match="failed unexpectedly") as bug:
                await pool.run(int, "not a number", timeout_s=30)
            assert bug.value.status == 500

            # A caller that gives up does not cost the worker: its job runs out and the worker returns.
            pid = await pool.run(os.getpid, timeout_s=30)
            abandoned = asyncio.ensure_future(pool.run(time.sleep, 1.0, timeout_s=30))
            await asyncio.sleep(0.2)
            abandoned.cancel()
            assert await pool.run(os.getpid, timeout_s=30) == pid

            # Every failure above replaced or kept the single worker: it still serves.
            assert await pool.run(math.hypot, 6, 8, timeout_s=30) == 10.0
        finally:
            await pool.close()

    asyncio.run(scenario())
