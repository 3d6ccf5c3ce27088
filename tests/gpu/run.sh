#!/usr/bin/env bash
# Every GPU check and benchmark, or the named ones, on a machine with one NVIDIA GPU (the H200 test machines):
#   tests/gpu/run.sh OUT_DIR [NAME ...]     NAME: check_ray bench_ipc_sync run_loop check_memory bench_trainer
#                                            check_packing bench_hf_engine bench_loop (default: these, in this
#                                            order), or profile_trainer (torch profiler, slow), check_trainer (two GPUs),
#                                            check_expert_parallel (2 or 4 GPUs; check_context_parallel: torchrun)
# Installs the carried wheels first (tests/gpu/setup_device.sh; build them with tests/gpu/make_carry.sh). Each
# script writes its JSON report under OUT_DIR (named in its docstring) and OUT_DIR/NAME.log; at the end, OUT_DIR.tar.gz
# holds them all (one file to copy off the machine). bench_loop runs the modes of BENCH_LOOP_MODES (default
# full+fixed,full+alternate+fixed). The exit status is the number of scripts that failed.
set -uo pipefail
out=${1:?OUT_DIR}
shift
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(check_ray bench_ipc_sync run_loop check_memory bench_trainer check_packing bench_hf_engine bench_loop)
source "$(dirname "$0")/setup_device.sh" "${MOLT_CARRY:-.gpuwheels}" >/dev/null
mkdir -p "$out"
baseline="${MOLT_CARRY:-.gpuwheels}/plain_baseline.py"
failed=0
for name in "${names[@]}"; do
  args=("$out")
  case $name in bench_trainer|bench_ipc_sync|profile_trainer) args+=(--baseline "$baseline");;
    bench_loop) args+=(--checkpoint "${BENCH_LOOP_MODES:-full+fixed,full+alternate+fixed}");; esac
  echo "== $name"
  start=$SECONDS
  python3 "tests/gpu/$name.py" "${args[@]}" > "$out/$name.log" 2>&1 || { failed=$((failed + 1)); echo "   FAILED (see $out/$name.log)"; }
  tail -c 1500 "$out/$name.log"
  echo "   $name took $((SECONDS - start)) s"
done
tar czf "${out%/}.tar.gz" -C "$(dirname "$out")" "$(basename "$out")" && echo "reports: ${out%/}.tar.gz"
exit $failed
