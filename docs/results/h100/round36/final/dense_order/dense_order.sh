# The dense 1B recipe twice, fpatch and sdpa in both orders, with the GPU's clocks, power and throttle reasons
# sampled every 200 ms: are fpatch's slow steps the GPU's (clocks) or the host's?
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
unset TRITON_INTERPRET
if ! python3 -c "import datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 200 > "$OUT/clocks.csv" &
smi=$!
for order in fpatch,sdpa sdpa,fpatch; do
  echo "== $order $(date +%T.%N)" | tee -a "$OUT/marks.txt"
  accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/train.py --config configs/llama_1b.yaml \
    --implementations "$order" --output_dir "$OUT/$order" 2>"$OUT/${order}_progress.log" | tee "$OUT/$order.md"
  echo "== end $(date +%T.%N)" | tee -a "$OUT/marks.txt"
done
kill $smi
python3 - "$OUT" <<'PY'
import json, sys
for order in ("fpatch,sdpa", "sdpa,fpatch"):
    for r in json.load(open(f"{sys.argv[1]}/{order}/results.json"))["results"]:
        print(order, r["implementation"], round(r["tokens_per_s"]), r["step_time_ms"], r["step_time_ms_median"],
              r["step_times_ms"])
PY
