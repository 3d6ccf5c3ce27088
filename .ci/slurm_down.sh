#!/usr/bin/env bash
# Stop the test Slurm started by .ci/slurm_up.sh: only the pids it recorded, and only when no live holder
# is left (or with --force).
#
#   .ci/slurm_down.sh [--holder ID] [--force]
set -euo pipefail

D=${MOLT_SLURM_DIR:-/tmp/molt-slurm}
holder=manual force=0
while [ $# -gt 0 ]; do
  case "$1" in
    --holder) holder=$2; shift 2 ;;
    --force) force=1; shift ;;
    *) echo "slurm_down.sh: unknown argument '$1' (usage: slurm_down.sh [--holder ID] [--force])" >&2; exit 2 ;;
  esac
done
[ -d "$D" ] || exit 0
exec 9>"$D/lock"
flock -w 120 9 || { echo "slurm_down: another slurm_up/slurm_down holds $D/lock" >&2; exit 1; }

rm -f "$D/holders/$holder"
# A holder id that is a pid of a process that has gone away no longer holds anything.
for h in "$D"/holders/*; do
  [ -e "$h" ] || continue
  id=$(basename "$h")
  if [[ "$id" =~ ^[0-9]+$ ]] && ! kill -0 "$id" 2>/dev/null; then rm -f "$h"; fi
done
if [ "$force" = 0 ] && [ -n "$(ls -A "$D/holders" 2>/dev/null)" ]; then
  echo "slurm_down: still held by $(ls "$D/holders" | tr '\n' ' '); leaving Slurm running" >&2
  exit 0
fi

pids=()
for f in "$D"/slurmd-n1.mypid "$D"/slurmd-n2.mypid "$D"/slurmctld.mypid "$D"/munged.mypid; do
  [ -s "$f" ] && pids+=("$(cat "$f")")
done
export SLURM_CONF="$D/slurm.conf"
# Cancel what is still queued or running, so no job step outlives the daemons.
[ -s "$D/slurmctld.mypid" ] && kill -0 "$(cat "$D/slurmctld.mypid")" 2>/dev/null \
  && timeout 10 scancel --full --quiet --partition=debug 2>/dev/null || true
# Only the pids slurm_up.sh recorded: TERM, up to 5 s to exit, then KILL.
for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
for pid in "${pids[@]}"; do
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
done
rm -f "$D"/slurmd-n1.mypid "$D"/slurmd-n2.mypid "$D"/slurmctld.mypid "$D"/munged.mypid
rm -rf "$D/holders"
echo "slurm_down: stopped" >&2
