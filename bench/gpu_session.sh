#!/usr/bin/env bash
# One lease of a CUDA GPU, run as one command from the repository root: the demo, the tests
# with their tensors on the GPU (tests/conftest.py: TJIT_TEST_DEVICE=cuda) and bench/gpu.py.
# Each stage has its own time limit, so one that hangs leaves the others their time; logs go
# to $OUT (or ./gpu_out). Stage limits (seconds) can be set: DEMO_S, TESTS_S, BENCH_S.
#   TEST_FILES="tests/test_a.py ..."   the test files (default: all of tests/; on an H100 the
#                                      12 files of the first session took 68 s on 15 workers)
#   BENCH_ARGS="--sections ..."        bench/gpu.py's arguments
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi -L
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
# the Dynamo backend's entry point (backend="tjit"); no dependencies are fetched
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 || echo "install failed (see install.log)"

if [ "${DEMO_S:-90}" != 0 ]; then  # (a stage given 0 seconds is left out)
  timeout "${DEMO_S:-90}" $PY demo.py >"$OUT/demo.log" 2>&1
  echo "demo rc $?"; tail -n 15 "$OUT/demo.log"
fi

TEST_FILES=${TEST_FILES:-tests}
[ "${TESTS_S:-300}" != 0 ] && TJIT_TEST_DEVICE=cuda TJIT_FAILURE_LOG="$OUT/failures.log" timeout "${TESTS_S:-300}" $PY -m pytest -v -n "${WORKERS:-14}" -p no:cacheprovider \
  -o addopts="" --tb=short --continue-on-collection-errors $TEST_FILES >"$OUT/tests.log" 2>&1
echo "tests rc $?"
grep -c " PASSED " "$OUT/tests.log" | sed 's/^/passed: /'
grep -E " (FAILED|ERROR) " "$OUT/tests.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort | uniq | head -n 60

timeout "${BENCH_S:-240}" $PY bench/gpu.py ${BENCH_ARGS:-} --json "$OUT/gpu.json" >"$OUT/bench.log" 2>"$OUT/bench.err"
echo "bench rc $?"; cat "$OUT/bench.log"; tail -n 5 "$OUT/bench.err"
