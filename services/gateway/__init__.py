"""perigee gateway: OpenAI-compatible HTTP in front of the NATS request path.

``python -m services.gateway --nats URL --port 8000 ...``; see :mod:`services.gateway.server`
for a request's lifecycle and :mod:`services.gateway.watchdog` for how dead workers are
noticed.
"""

from services.gateway.server import Gateway, GatewayConfig

__all__ = ["Gateway", "GatewayConfig"]
