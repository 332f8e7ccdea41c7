# The method of §3 as a script: two trees in turn on the GPU machine, whose copy of the checkout has no .git (so no
# `tandem bench suite --against`). Each tree is a `git archive COMMIT -o NAME.tar` carried in beside this
# checkout, unpacked and given this checkout's native build (the two trees' native/ were the same).
#   TARS="base.tar new.tar" CONTEXTS="32768 32768 2048" RES=out bash ab_trees.sh
# Each context runs every tree once, in the order given, then the next context reverses the order.
# MODEL (default synthetic:qwen3-30b-a3b-L16: BF16) may be a GGUF path; POLICIES reaches ab_split.py.
source benchmarks/h200/lease_start.sh  # folders, log, wheels, native build, machine header
here=$(cd "$(dirname "$0")" && pwd)
order=(${TARS:?name the tarballs})
for t in "${order[@]}"; do
  name=$(basename "$t" .tar)
  mkdir -p "$work/$name" && tar -xf "$t" -C "$work/$name" && cp engine/_native*.so "$work/$name/engine/"
done
n=0
for ctx in ${CONTEXTS:-32768 2048}; do
  for t in "${order[@]}"; do
    name=$(basename "$t" .tar); n=$((n + 1))
    step "$name $ctx #$n"
    (cd "$work/$name" && PYTHONPATH="$work/$name:/tmp/site" timeout 200 python3 "$here/ab_split.py" \
      "${MODEL:-synthetic:qwen3-30b-a3b-L16}" "$ctx" "$work/$name-$ctx-$n.json" "$name") >>"$res/ab.txt" 2>>"$res/err.txt"
  done
  order=($(printf '%s\n' "${order[@]}" | tac))
done
(cd "$work" && tar -czf "$res/json.tgz" ./*.json)
step ALL DONE
