"""services.common.runner: what every service's process does around its event loop."""

import gc

from services.common import runner


def test_the_heap_built_before_the_loop_is_frozen():
    gc.unfreeze()
    built = [[i] for i in range(5000)]  # start-up's objects, tracked by the collector
    try:

        async def main() -> int:
            return gc.get_freeze_count()

        # A full collection no longer walks them: they are in the permanent generation.
        assert runner.run(main()) >= len(built)
    finally:
        gc.unfreeze()
