#!/bin/bash
# One device call: GPU tests, then deepinfer-bench step on the rebuilt engine (after) and the pre-issue engine
# (before, .before/ + its probe shim). DEV/V4/V41/B/C/BOLD/PRE/IT/T* can be overridden for a CPU dry run.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
DEV=${DEV:-cuda}; V4=${V4:-random:deepseek_v4:flash:4}; V41=${V41:-random:deepseek_v41:flash:4}
B=${B:-1,16,64,256}; C=${C:-1024,8192}; BOLD=${BOLD:-1,16,64}; PRE=${PRE:-8192}; IT=${IT:-10}; DT=${DT:-bfloat16}
OUT=${OUT_DIR:-./step-out}; mkdir -p $OUT /tmp/runs
mkpkg() { rm -rf $2; mkdir -p $2/deepinfer; cp -r $1/engine/. $2/deepinfer/; cp -r $1/kernels $2/deepinfer/kernels; cp -r $1/harness $2/deepinfer/harness; cp -r $1/eval $2/deepinfer/evals; }
mkpkg . /tmp/pkg; mkpkg .before /tmp/pkg_before
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null | tee $OUT/bench.log
if [ -n "$TESTS" ]; then
  PYTHONPATH=/tmp/pkg timeout ${TT:-120} python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS 2>&1 | tail -30 > $OUT/gpu_tests.log
  tail -5 $OUT/gpu_tests.log
fi
bench() {  # name pkg seconds model storage batches contexts prefill
  local name=$1 pkg=$2 t=$3; shift 3
  echo "== $name" | tee -a $OUT/bench.log
  (cd /tmp && PYTHONPATH=$pkg timeout $t python3 $OLDPWD/reports/1/step-h200-method/run_step.py /tmp/runs/$name "$1" "$2" "$3" "$4" "$5" $IT $DEV $DT) 2>&1 | grep -v "^INFO\|Warning\|warn" | tail -25 | tee -a $OUT/bench.log
  cp /tmp/runs/$name/rows.jsonl $OUT/$name.jsonl 2>/dev/null
}
bench after-v4 /tmp/pkg ${T1:-100} $V4 dense $B $C $PRE
bench after-v41 /tmp/pkg ${T2:-120} $V41 fp4 $B $C $PRE
bench before-v4 /tmp/pkg_before ${T3:-100} $V4 dense $B $C $PRE
bench before-v41 /tmp/pkg_before ${T4:-120} $V41 fp4 $BOLD $C $PRE
ls -la $OUT
