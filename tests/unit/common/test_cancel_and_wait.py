"""cancel_and_wait ends a task whose first cancellation was lost (the Python 3.11
wait_for race that hung a store's stop), and reports one that ignores them all."""

import asyncio
import sys

from services.common.tasks import cancel_and_wait


async def test_ends_a_task_that_lost_its_first_cancellation():
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    reached_queue = asyncio.Event()
    queue: asyncio.Queue[int] = asyncio.Queue()
    lost = []

    async def worker() -> None:
        try:
            await asyncio.wait_for(inner, 60)
        except asyncio.CancelledError:
            raise
        lost.append(True)  # the cancellation did not arrive: the task runs on
        reached_queue.set()
        await queue.get()

    task = asyncio.create_task(worker())
    await asyncio.sleep(0)  # the worker is inside wait_for
    inner.set_result(1)
    task.cancel()  # in the same step as the inner result
    if sys.version_info < (3, 12):  # the race this helper is for: the task runs on
        await reached_queue.wait()
        assert lost == [True] and not task.done()
    left = await cancel_and_wait([task], retry_s=0.05)
    assert left == set()
    assert task.done()


async def test_a_task_that_swallows_one_cancel_is_cancelled_again():
    released = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            pass  # swallowed once, as a lost cancellation looks from outside
        released.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    assert await cancel_and_wait([task], retry_s=0.05) == set()
    assert released.is_set() and task.cancelled()


async def test_a_task_that_ignores_every_cancel_is_reported_not_awaited_forever():
    stop = asyncio.Event()

    async def immortal() -> None:
        while not stop.is_set():
            try:
                await stop.wait()
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(immortal(), name="immortal")
    await asyncio.sleep(0)
    left = await cancel_and_wait([task], retry_s=0.01, bound_s=0.05)
    assert left == {task}
    stop.set()
    await task


async def test_exceptions_are_retrieved_and_finished_tasks_skipped():
    async def boom() -> None:
        raise RuntimeError("x")

    failed = asyncio.create_task(boom())
    finished = asyncio.create_task(asyncio.sleep(0))
    await asyncio.wait([failed, finished])
    assert await cancel_and_wait([failed, finished]) == set()
