"""``python -m services.engine``: the engine is a library, not a service.

The prefill and decode workers load it in-process (``--engine vllm|mock`` of
``python -m services.prefill`` / ``services.decode``, or of ``perigee up``): there is
no engine process to start. This entry point only says so (``--help``: exit 0).
"""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    print(__doc__.strip(), file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
    return 0 if argv[:1] in (["-h"], ["--help"]) else 2


if __name__ == "__main__":
    sys.exit(main())
