# The start both lease scripts share (sourced, from the repository root): the results and work
# folders, a progress log with `step`, the carried wheels, the native build, and the machine's
# header. Then each script starts llama.cpp's build with the targets it needs.
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
