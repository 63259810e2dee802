#!/usr/bin/env bash
# One entry point for developers and CI.
#
#   ./dev.sh setup   install what is missing, then build the extension in place
#   ./dev.sh test    setup, then run the test suite
#   ./dev.sh demo    setup, then run the layer-by-layer training demo
#   ./dev.sh prebuild DIR
#                    build the extension for another machine's Python and torch (PYTHON=that venv's python, e.g. one
#                    with the GPU box's torch 2.11.0+cu130 on Python 3.12) from a copy of this tree, stripped, with a
#                    stamp; `TORCH_CONVBIAS_PREBUILT=DIR ./dev.sh ...` on that machine then skips the ~150 s build
#                    when the stamp matches (same Python, torch, cuDNN wheel and csrc/ + setup.py), else builds
#   ./dev.sh carry [DIR]
#                    what a call to the GPU machine carries (default .carry): cuDNN frontend headers and a prebuild for
#                    its Python 3.12 / torch 2.11.0+cu130 (see carry below for the call)
#   ./dev.sh jobs DIR
#                    the JOBS list of `gpu DIR jobs` (below) without setup, on a tree already built; groups of jobs
#                    separated by `|` run side by side (run_streams)
#   ./dev.sh stamp   print this tree's build stamp; ./dev.sh use-prebuilt: only the TORCH_CONVBIAS_PREBUILT step of
#                    setup
#   ./dev.sh gpu DIR [all|tests|bench|sanitize|jobs]
#                    on the GPU machine: setup, then the doctor and the CUDA tests (tests), every benchmark and
#                    the demo on cuda (bench), or both (all), or compute-sanitizer's memcheck, racecheck and synccheck
#                    over bench/sanitize_workload.py (sanitize), or a budgeted list of single jobs (jobs: JOBS and BUDGET,
#                    see run_jobs); logs and results into DIR (`./dev.sh gpu $OUT tests`);
#                    BENCHES="param_grad bias_grad" picks benchmarks (forward param_grad layerwise bias_grad
#                    overhead demo; also stress_memory, cold_start, models, ddp (WORLD GPUs, default 2) and the
#                    activation blocks forward_<act> and layerwise_<act>, e.g. forward_relu layerwise_gelu, and
#                    forward_residual_<act>, not in the default list)
#
# setup installs only what is missing: on a fresh CPU machine with PyPI, torch 2.14.1, pytest, scikit-learn,
# cmake and the cuDNN frontend headers; on a machine that already has them (a GPU box without network, with
# CUDNN_FRONTEND_INCLUDE_DIR pointing at carried headers) it installs nothing and only builds.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_CONVBIAS_TORCH_VERSION:-2.14.1}
FRONTEND_VERSION=${TORCH_CONVBIAS_FRONTEND_VERSION:-1.32.0}

has_module() { "$PYTHON" -c "import $1" >/dev/null 2>&1; }
has_dist() { "$PYTHON" -c "import importlib.metadata as m; m.distribution('$1')" >/dev/null 2>&1; }

# What a build depends on besides the compiler: Python, torch and the cuDNN wheel versions, and the sources.
build_stamp() {
  "$PYTHON" - <<'EOF'
import hashlib
import importlib.metadata as metadata
import pathlib
import sys

import torch

digest = hashlib.sha256()
for path in sorted([*pathlib.Path("csrc").rglob("*"), pathlib.Path("setup.py")]):
    if path.is_file():
        digest.update(str(path).encode() + b"\0" + path.read_bytes())
try:
    cudnn = metadata.version("nvidia-cudnn-cu13")
except metadata.PackageNotFoundError:
    cudnn = "-"
print(f"python={sys.version_info[0]}.{sys.version_info[1]} torch={torch.__version__} cudnn={cudnn} "
      f"sources={digest.hexdigest()[:16]}")
EOF
}

# TORCH_CONVBIAS_PREBUILT=DIR (from `./dev.sh prebuild DIR`): use its libraries when its stamp is this machine's and
# they import; returns 1 (build instead) otherwise, saying why.
use_prebuilt() {
  local dir=${TORCH_CONVBIAS_PREBUILT:-}
  [ -n "$dir" ] || return 1
  local want have
  want=$(cat "$dir/stamp.txt" 2>/dev/null) || { echo "dev.sh: no $dir/stamp.txt; building"; return 1; }
  have=$(build_stamp)
  if [ "$want" != "$have" ]; then
    echo "dev.sh: prebuilt for '$want', this is '$have'; building"
    return 1
  fi
  cp "$dir/_C.so" "$dir/libtorch_convbias.so" torch_convbias/
  if ! "$PYTHON" -c "import torch_convbias" >/dev/null 2>&1; then
    echo "dev.sh: the prebuilt libraries do not import here; building"
    rm -f torch_convbias/_C.so torch_convbias/libtorch_convbias.so
    return 1
  fi
  echo "dev.sh: using the prebuilt libraries of $dir ($want)"
}

prebuild() {
  local out=${1:?usage: PYTHON=/path/to/venv/bin/python ./dev.sh prebuild OUTDIR}
  local work
  out=$(realpath -m "$out")
  work=$(mktemp -d)
  # The tree as it is (tracked and untracked, not ignored files), so that the stamp's sources are these.
  git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$work"
  (cd "$work" && MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" setup.py --quiet build_ext --inplace) || { rm -rf "$work"; return 1; }
  mkdir -p "$out"
  for lib in _C.so libtorch_convbias.so; do
    strip --strip-debug -o "$out/$lib" "$work/torch_convbias/$lib"
  done
  (cd "$work" && build_stamp) > "$out/stamp.txt"
  rm -rf "$work"
  echo "dev.sh: prebuilt into $out: $(cat "$out/stamp.txt")"
}

setup() {
  local missing=()
  has_module torch || missing+=("torch==$TORCH_VERSION")
  has_module pytest || missing+=(pytest)
  has_module sklearn || missing+=(scikit-learn)
  if [ -z "${CUDNN_FRONTEND_INCLUDE_DIR:-}" ] && ! has_dist nvidia-cudnn-frontend; then
    missing+=("nvidia-cudnn-frontend==$FRONTEND_VERSION")
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    echo "dev.sh: installing ${missing[*]}"
    "$PYTHON" -m pip install --quiet "${missing[@]}"
  fi
  # cmake for tests/test_libtorch_example.py (a C++ program built against the library); optional: without a
  # network (the GPU box) that test skips.
  if ! command -v cmake >/dev/null 2>&1 && ! has_module cmake; then
    "$PYTHON" -m pip install --quiet cmake || echo "dev.sh: cmake not installed; the LibTorch example test will skip"
  fi
  use_prebuilt && return 0
  echo "dev.sh: building torch_convbias._C against torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
  MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PYTHON" setup.py --quiet build_ext --inplace
}

# `./dev.sh carry [DIR]`: what a GPU call carries (default .carry, ignored by git): the cuDNN frontend headers (the GPU
# machine has no network) and the extension prebuilt for its Python 3.12 and torch 2.11.0+cu130, from a venv made
# with GPU_PYTHON (a Python 3.12; default python3.12 on PATH, else pyenv's). The call, with carry [".carry"]:
#   TORCH_CONVBIAS_COMMIT=<sha> CUDNN_FRONTEND_INCLUDE_DIR=$PWD/.carry/cudnn_frontend/include \
#   TORCH_CONVBIAS_PREBUILT=$PWD/.carry/prebuilt JOBS="..." BUDGET=540 ./dev.sh gpu $OUT jobs
carry() {
  local dir venv python include
  dir=$(realpath -m "${1:-.carry}")
  venv=${GPU_VENV:-/tmp/convbias-gpu-venv}
  python=${GPU_PYTHON:-$(command -v python3.12 || ls -d "$HOME"/.pyenv/versions/3.12.*/bin/python 2>/dev/null | tail -1)}
  [ -n "$python" ] || { echo "dev.sh carry: no Python 3.12 found; set GPU_PYTHON"; return 1; }
  mkdir -p "$dir"
  include=$("$PYTHON" -c 'import importlib.metadata as m; print(m.distribution("nvidia-cudnn-frontend").locate_file("include"))')
  rm -rf "$dir/cudnn_frontend" && mkdir -p "$dir/cudnn_frontend" && cp -r "$include" "$dir/cudnn_frontend/include"
  if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
  fi
  # The GPU machine's versions (KINDS.md, shared/gpu.md): torch 2.11.0 (cu130), cuDNN 9.19.
  "$venv/bin/python" -m pip install --quiet torch==2.11.0 "nvidia-cudnn-cu13==9.19.*" setuptools ninja
  CUDNN_FRONTEND_INCLUDE_DIR="$dir/cudnn_frontend/include" PYTHON="$venv/bin/python" prebuild "$dir/prebuilt"
}

# The benchmarks BENCHES names (see the header; default forward param_grad layerwise bias_grad overhead demo) into
# OUT, their summaries printed and their full logs in OUT/bench-logs.tgz; no setup (the gpu phases and the jobs' bench
# kind have built already). Returns 1 if any failed.
run_benches() {
  local out=$1 name status=0
  for name in ${BENCHES:-forward param_grad layerwise bias_grad overhead demo}; do
    case "$name" in
      forward|param_grad|layerwise)
        "$PYTHON" -m "bench.bench_$name" --plot --out "$out" > "/tmp/bench_$name.log" 2>&1 || status=1
        grep -A12 "summary" "/tmp/bench_$name.log" | grep -v "^plot\|^results" | head -14 ;;
      forward_residual_*)  # forward_residual_relu: the residual block ending act(conv + bias + residual)
        "$PYTHON" -m bench.bench_forward --residual --activation "${name#forward_residual_}" --out "$out" > "/tmp/bench_$name.log" 2>&1 || status=1
        grep -A9 "summary" "/tmp/bench_$name.log" | head -11 ;;
      forward_*|layerwise_*)  # forward_relu, layerwise_gelu, ...: the conv + bias + activation block
        "$PYTHON" -m "bench.bench_${name%%_*}" --activation "${name#*_}" --out "$out" > "/tmp/bench_$name.log" 2>&1 || status=1
        grep -A8 "summary" "/tmp/bench_$name.log" | head -10 ;;
      models) "$PYTHON" -m bench.bench_models --out "$out" > /tmp/bench_models.log 2>&1 || status=1
        grep -E "^(vgg11|alexnet|resnet50)" /tmp/bench_models.log ;;
      bias_grad|overhead) "$PYTHON" -m "bench.bench_$name" --out "$out" 2>&1 | tail -6 || status=1 ;;
      cold_start) "$PYTHON" -m bench.bench_cold_start --out "$out" 2>&1 | tail -14 || status=1 ;;
      ddp) "$PYTHON" -m bench.bench_ddp --world "${WORLD:-2}" --out "$out" 2>&1 | tail -12 || status=1 ;;
      stress_memory) TORCH_CONVBIAS_CACHE_SIZE=${TORCH_CONVBIAS_CACHE_SIZE:-64} "$PYTHON" -m bench.stress_memory --out "$out" 2>&1 | tail -4 || status=1 ;;
      demo) "$PYTHON" examples/layerwise_digits.py --device cuda 2>&1 | tail -8 || status=1 ;;
      *) echo "dev.sh: unknown benchmark '$name'"; status=1 ;;
    esac
  done
  # The full tables (engines, paths) in one file: the device tool returns few files.
  tar czf "$out/bench-logs.tgz" -C /tmp $(cd /tmp && ls bench_*.log 2>/dev/null) 2>/dev/null || true
  return $status
}

# `./dev.sh gpu DIR jobs`: the JOBS list, in order, each run only if it fits in what is left of BUDGET seconds
# (counted from this script's start, the build included; a job skipped fails the run's status), each bounded by its own
# seconds; logs and results under DIR/jobs/, returned as one DIR/jobs.tgz (the device tool returns few files). Specs,
# separated by spaces:
#   models:MODEL:PHASE:MODE:SECONDS[:bwd]  one row of bench.bench_models (bwd: also the activation-backward variant)
#   tests:STEM:K:SECONDS                   tests/test_STEM.py -k K ('+' for a space; empty K: not cpu, i.e. its
#                                          CUDA tests and those without a device parameter)
#   bench:NAME:SECONDS                     one benchmark of the bench phase (forward, layerwise_relu, ...)
#   module:MODULE:ARGS:SECONDS             python -m MODULE ARGS --out <job dir> ('+' for a space), e.g.
#                                          module:bench.bench_forward:--activation+relu+--shapes+2+5:120
#   env:NAME=VALUE:0                       export NAME=VALUE for the jobs after it (e.g. env:TORCH_CONVBIAS_INPUT_GRAD=timed:0)
# Groups of jobs separated by '|' run side by side as streams (run_streams).
run_jobs() {
  local out=$1 spec kind rest seconds dir index=0 rc left status=0
  local budget=${BUDGET:-540}
  if [[ "${JOBS:?JOBS lists the jobs: see dev.sh}" == *"|"* ]]; then
    run_streams "$out"
    return
  fi
  mkdir -p "$out/jobs"
  : > "$out/jobs/summary.txt"
  for spec in ${JOBS:?JOBS lists the jobs: see dev.sh}; do
    index=$((index + 1))
    kind=${spec%%:*}
    rest=${spec#*:}
    seconds=${spec##*:}
    [ "$kind" = models ] && [[ "$spec" == *:bwd ]] && { seconds=${rest%:bwd}; seconds=${seconds##*:}; }
    left=$((budget - SECONDS))
    if [ "$seconds" -gt "$left" ]; then
      echo "skipped $spec (needs ${seconds}s, ${left}s left)" | tee -a "$out/jobs/summary.txt"
      status=1 # a job that did not run leaves the run unfinished: `jobs A && jobs B` must not go on to B
      continue
    fi
    dir="$out/jobs/$(printf %02d $index)-$(echo "$rest" | tr ':+ /' '___-')"
    mkdir -p "$dir"
    rc=0
    case "$kind" in
      models)
        IFS=: read -r model phase mode _ flag <<< "$rest"
        timeout "$seconds" "$PYTHON" -m bench.bench_models --models "$model" --phases "$phase" --modes "$mode" \
          ${flag:+--activation-backward-variant} --out "$dir" > "$dir/log.txt" 2>&1 || rc=$? ;;
      tests)
        IFS=: read -r stem expr _ <<< "$rest"
        expr=${expr//+/ }
        timeout "$seconds" "$PYTHON" -m pytest "tests/test_$stem.py" -q -rfEs --tb=short -p no:cacheprovider \
          -k "${expr:-not cpu}" > "$dir/log.txt" 2>&1 || rc=$? ;;
      bench)
        BENCHES=${rest%%:*} timeout "$seconds" "$0" benches "$dir" > "$dir/log.txt" 2>&1 || rc=$? ;;
      module)
        IFS=: read -r module arguments _ <<< "$rest"
        # shellcheck disable=SC2086 # the arguments split at the spaces '+' stood for
        timeout "$seconds" "$PYTHON" -m "$module" ${arguments//+/ } --out "$dir" > "$dir/log.txt" 2>&1 || rc=$? ;;
      env)
        # env:NAME=VALUE:0 sets a variable for the jobs after it (e.g. a TORCH_CONVBIAS_* knob, read once per process).
        IFS=: read -r assignment _ <<< "$rest"
        if [[ "$assignment" =~ ^[A-Z_][A-Z0-9_]*=.*$ ]]; then
          export "${assignment?}"
          echo "export $assignment" > "$dir/log.txt"
        else
          echo "env job expects NAME=VALUE, got '$assignment'" > "$dir/log.txt"; rc=2
        fi ;;
      *) echo "unknown job kind '$kind' in '$spec'" > "$dir/log.txt"; rc=2 ;;
    esac
    [ $rc -eq 0 ] || status=1
    echo "rc=$rc at ${SECONDS}s $spec: $(grep -v '^\s*$' "$dir/log.txt" | tail -1)" | tee -a "$out/jobs/summary.txt"
  done
  tar czf "$out/jobs.tgz" -C "$out" jobs && rm -rf "$out/jobs"
  return $status
}

# JOBS="a b | c d": the groups between '|' run side by side, each a stream of its own (its own process, order and
# BUDGET; an env: job holds for its stream only), for correctness tests, which do not mind sharing the GPU (benchmarks
# and timed choices do: keep those in a run of their own). One DIR/jobs.tgz: jobs/stream<i>/<job>/log.txt and a
# summary of every stream's jobs, each line prefixed with its stream.
run_streams() {
  local out=$1 i status=0
  local -a streams pids=()
  IFS='|' read -ra streams <<< "$JOBS"
  for i in "${!streams[@]}"; do
    JOBS=${streams[i]} "$0" jobs "$out/streams/$i" > /dev/null 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    wait "${pids[i]}" || status=1
  done
  mkdir -p "$out/jobs"
  : > "$out/jobs/summary.txt"
  for i in "${!streams[@]}"; do
    mkdir -p "$out/jobs/stream$i"
    tar xzf "$out/streams/$i/jobs.tgz" -C "$out/jobs/stream$i" --strip-components=1
    sed "s/^/stream $i: /" "$out/jobs/stream$i/summary.txt" >> "$out/jobs/summary.txt"
    rm "$out/jobs/stream$i/summary.txt"
  done
  cat "$out/jobs/summary.txt"
  tar czf "$out/jobs.tgz" -C "$out" jobs && rm -rf "$out/jobs" "$out/streams"
  return $status
}

case "${1:-}" in
  setup) setup ;;
  prebuild) shift; prebuild "$@" ;;
  carry) shift; carry "$@" ;;
  # run_benches alone, for the jobs' bench kind (the build is done by then).
  benches) run_benches "${2:?usage: ./dev.sh benches OUTDIR}" ;;
  # run_jobs alone, on a tree already built (tests/test_dev_jobs.py runs the runner this way on the CPU).
  jobs) run_jobs "${2:?usage: JOBS=... ./dev.sh jobs OUTDIR}" ;;
  # What prebuild stamps and setup compares (tests/test_dev_prebuilt.py drives both in a scratch tree).
  stamp) build_stamp ;;
  use-prebuilt) use_prebuilt ;;
  test) setup; shift; exec "$PYTHON" -m pytest tests "$@" ;;
  demo) setup; shift; exec "$PYTHON" examples/layerwise_digits.py "$@" ;;
  gpu)
    out=${2:?usage: ./dev.sh gpu OUTDIR [all|tests|bench]}
    phase=${3:-all}
    mkdir -p "$out"
    # The device tool returns at most 8 files: tests.log (tests), a JSON + PNG per training benchmark and the bias and
    # overhead JSONs (bench): run the phases in separate calls.
    setup > /tmp/convbias-build.log 2>&1 || { cp /tmp/convbias-build.log "$out/"; tail -40 /tmp/convbias-build.log; exit 1; }
    status=0
    if [ "$phase" = all ] || [ "$phase" = tests ]; then
      # The CPU tests run in CI; here the CUDA ones (and every test that takes a device parameter on cuda).
      # The suite takes longer than one device call allows when run in one process: SHARDS processes (default 3)
      # share the GPU, each taking every SHARDS-th test file (largest first), each bounded by TEST_TIMEOUT seconds.
      "$PYTHON" -m torch_convbias.doctor > "$out/tests.log" 2>&1 || status=1
      shards=${SHARDS:-3}
      # TEST_FILES="tests/test_a.py tests/test_b.py" runs only those (e.g. what a previous run did not reach).
      mapfile -t files < <(ls -S ${TEST_FILES:-tests/test_*.py})
      pids=()
      for ((i = 0; i < shards; i++)); do
        mine=()
        for ((j = i; j < ${#files[@]}; j += shards)); do mine+=("${files[j]}"); done
        timeout "${TEST_TIMEOUT:-540}" "$PYTHON" -m pytest "${mine[@]}" -q -rfEs --tb=short -k "not cpu" \
          -p no:cacheprovider --junitxml="/tmp/convbias-junit-$i.xml" > "/tmp/convbias-tests-$i.log" 2>&1 &
        pids+=($!)
      done
      for ((i = 0; i < shards; i++)); do
        wait "${pids[i]}" || status=1
        { echo "== shard $i"; cat "/tmp/convbias-tests-$i.log"; } >> "$out/tests.log"
        tail -1 "/tmp/convbias-tests-$i.log"
      done
      grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -30 || true
      # Properties the tests record (the CUDA fuzzer's path coverage counts) from the shards' JUnit reports.
      grep -ho '<property name="[^"]*" value="[^"]*"' /tmp/convbias-junit-*.xml 2>/dev/null | tee -a "$out/tests.log" || true
    fi
    if [ "$phase" = all ] || [ "$phase" = bench ]; then
      run_benches "$out" || status=1
    fi
    if [ "$phase" = jobs ]; then
      run_jobs "$out" || status=1
    fi
    if [ "$phase" = sanitize ]; then
      # compute-sanitizer over bench/sanitize_workload.py: memcheck (out-of-bounds and misaligned accesses, all
      # kernels), racecheck and synccheck (shared-memory races and barrier misuse) on one thread's calls. Each tool
      # is bounded (SANITIZE_TIMEOUT seconds): the sanitizer slows cuDNN's kernels 10-100x.
      : > "$out/sanitize.log"
      # SANITIZE_TOOLS="synccheck" runs a subset.
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
        args=(--quick)
        [ "$tool" = memcheck ] && args=(--threads 2 --rounds 1)
        echo "== compute-sanitizer --tool $tool" >> "$out/sanitize.log"
        rc=0
        timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --target-processes all --error-exitcode 3 \
          "$PYTHON" -m bench.sanitize_workload "${args[@]}" >> "$out/sanitize.log" 2>&1 || rc=$?
        echo "== $tool exit $rc" >> "$out/sanitize.log"
        [ $rc -eq 0 ] || status=1
      done
      grep -E "^== |ERROR SUMMARY|sanitize_workload:" "$out/sanitize.log" || true
    fi
    exit $status ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 2 ;;
esac
