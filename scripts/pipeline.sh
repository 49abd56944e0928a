#!/usr/bin/env bash
# Runs both stages at the same time on one run config: vt-precompute fills the shard window while
# vt-train consumes it. If either stage fails, the other is stopped and the exit status is non-zero.
#   usage: scripts/pipeline.sh CONFIG [--set key=value ...]
set -uo pipefail
config=${1:?usage: scripts/pipeline.sh CONFIG [--set key=value ...]}
shift
bin=$(dirname "$0")/../.venv/bin
"$bin/vt-precompute" run "$config" "$@" &
producer=$!
"$bin/vt-train" run "$config" "$@" &
trainer=$!
trap 'kill $producer $trainer 2>/dev/null' INT TERM
status=0
# Whichever stage ends first: a failure stops the other one.
wait -n $producer $trainer || { status=$?; kill $producer $trainer 2>/dev/null; }
wait $producer || status=$((status ? status : $?))
wait $trainer || status=$((status ? status : $?))
exit $status
