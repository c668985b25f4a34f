"""The services, one runnable package per role (``python -m services.<role>``): they meet
on the bus, never in imports; what several share lives in :mod:`services.common`."""
