"""A prefill or decode worker process: ``main`` (arguments, engine and store set-up,
run until a signal), ``factory`` (the one place a worker of either role is built),
``role_host`` (a worker that switches role live) and ``base`` (what both roles share
around a request's lifecycle)."""
