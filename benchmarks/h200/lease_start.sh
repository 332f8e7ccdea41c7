# The start both lease scripts share (sourced, from the repository root): the results and work
# folders, a progress log with `step`, the carried wheels, the native build, and the machine's
# header, and `llama_build TARGETS` for each script to start llama.cpp's build with the targets it needs.
set -uo pipefail
res=${RES:-/tmp/lease}; work=${WORK:-$res/work}; mkdir -p "$res" "$work"
log="$res/progress.log"
step() { echo "=== $* ($(date -u +%T))" | tee -a "$log"; }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$log" 2>&1 || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1

# the commit of the `git archive` the tree came from (git writes it into ARCHIVE_COMMIT: export-subst)
archived=$(cat benchmarks/h200/ARCHIVE_COMMIT 2>/dev/null)
case "$archived" in *Format*) archived=$(git rev-parse HEAD 2>/dev/null);; esac
step start "${archived:-${COMMIT:-unknown}}"
python3 setup.py -q build_ext --inplace >>"$res/build.log" 2>&1 || step "native build FAILED"
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,driver_version --format=csv >>"$log"
free -g >>"$log"; df -h / >>"$log"

# llama.cpp's CUDA build into $work/llamacpp in the background, its pid in $build (empty when the
# targets are already built there: a warm machine's second call). TARGETS: comma-separated.
llama_build() {
  build=
  local t missing=
  for t in ${1//,/ }; do [ -x "$work/llamacpp/build-cuda/bin/$t" ] || missing=1; done
  [ -n "$missing" ] || return 0
  step llama.cpp build starts in the background
  python3 -m engine.bench.llamacpp_build --source .llamacpp/llamacpp-src.tar.xz --build-dir "$work/llamacpp" \
    --targets "$1" >"$res/llamacpp-build.log" 2>&1 &
  build=$!
}
