"""Prefill instances: ``python -m services.prefill --nats URL --instance prefill-0 --node p0``.

The worker (:mod:`services.prefill.worker`) is a thin adapter over the pure queue
(:mod:`services.prefill.queue`) and an engine (:mod:`services.engine`)."""
