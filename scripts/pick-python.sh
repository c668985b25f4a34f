#!/usr/bin/env bash
# The interpreter the Makefile makes its venvs with: the distro's CPython 3.11 where
# it has one that can make a venv (Debian's is built with PGO and linked statically),
# else python3 on the PATH. A build without those (this machine's pyenv 3.11: shared
# libpython, no PGO or LTO) costs the mock stack about 9 % more CPU a request at 400
# req/s (BENCHMARKS.md, capacity, session 27). The image's python:3.11-slim is
# optimised.
candidate=${DISTRO_PYTHON:-/usr/bin/python3.11}
if "$candidate" -c 'import sys, ensurepip; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "$candidate"
else
  echo python3
fi
