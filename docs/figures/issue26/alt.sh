#!/bin/bash
# usage: pair.sh KIND ROUND   (KIND: pipeline | ship | sim); runs before then after
kind=$1; r=$2
for side in before after; do
  wt=/work/wt-$side; out=/tmp/alt26/$kind-$side-$r; mkdir -p $out
  echo "== $kind $side round $r start $(date -u +%T) $(uptime)" | tee -a /tmp/alt26/log
  cd $wt
  case $kind in
    pipeline) cmd=(perigee bench pipeline --rate 10 --requests 200 --log-dir $out/logs --json $out/pipeline.json);;
    ship) cmd=(perigee bench ship --no-mooncake --json $out/ship.json);;
    sim) cmd=(perigee sim repro all --out $out);;
    simsub) cmd=(bash -c "perigee sim repro fig5 --out $out && perigee sim repro cpp --out $out");;
  esac
  t0=$(date +%s.%N)
  PYTHONPATH=$wt PATH=/work/main/.venv/bin:$PATH nice -n -10 "${cmd[@]}" > $out/stdout 2> $out/stderr
  rc=$?
  t1=$(date +%s.%N)
  echo "== $kind $side round $r rc=$rc wall=$(echo "$t1 - $t0" | bc) s end $(uptime)" | tee -a /tmp/alt26/log
done
