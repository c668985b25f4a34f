#!/usr/bin/env bash
# Refuses placeholder secrets before they are deployed: exits 1, naming every key of the
# Secret's env file(s) whose value is empty or still contains REPLACE-ME (the template
# values of deploy/k8s/base/credentials.env), else 0. Run it before each apply:
#   scripts/check-secrets.sh && kubectl kustomize deploy/k8s/overlays/cpu | kubectl apply -f -
# kustomize has no validation step that could fail the render itself; the nats-servers
# and the services also refuse these values at start (CrashLoopBackOff), this says so
# before anything is applied.
#   scripts/check-secrets.sh [ENV_FILE...]   (default: deploy/k8s/base/credentials.env)
set -euo pipefail
shopt -s nocasematch  # as the services' check (services/common/placeholders.py)
root=$(cd "$(dirname "$0")/.." && pwd)
if [ $# -eq 0 ]; then
  set -- "$root/deploy/k8s/base/credentials.env"
fi
bad=0
for f in "$@"; do
  if [ ! -r "$f" ]; then
    echo "check-secrets: cannot read $f" >&2
    bad=1
    continue
  fi
  n=0
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
    key=${line%%=*}
    value=${line#*=}
    if [ "$key" = "$line" ]; then
      echo "check-secrets: $f:$n: not KEY=VALUE: $line" >&2
      bad=1
    elif [[ $value == *REPLACE-ME* ]]; then
      echo "check-secrets: $f:$n: $key is still the placeholder $value" >&2
      bad=1
    elif [ -z "$value" ]; then
      echo "check-secrets: $f:$n: $key is empty" >&2
      bad=1
    fi
  done <"$f"
done
if [ "$bad" -ne 0 ]; then
  echo "check-secrets: refusing: replace the values above (or create the Secret" \
    "perigee-credentials yourself and drop the secretGenerator), then apply;" \
    "README 'Deploy on Kubernetes'" >&2
  exit 1
fi
echo "check-secrets: no placeholder or empty value in $*"
