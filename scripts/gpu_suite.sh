#!/usr/bin/env bash
# The GPU session in one call: GPU tests, kernel tuning, benchmarks, recipes. Logs under $OUT, a short table last.
#   bash scripts/gpu_suite.sh [tests] [tune] [bench] [train] ...   (default: tests bench)
# On the device machine: carry .whl (datasets, dill, multiprocess wheels, see README) and OUT is set.
set -uo pipefail
OUT=${OUT:-runs/gpu_suite}
mkdir -p "$OUT"
steps=${*:-tests bench}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, accelerate; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
  python3 -c "import datasets, pyarrow; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" || echo "datasets import failed"
} 2>&1 | tee "$OUT/env.txt"
summary=()
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests)
      python3 -m pytest -m gpu tests -q -rs -rP -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log"
      summary+=("tests: $(tail -n 1 "$OUT/pytest_gpu.log")") ;;
    tune)
      python3 scripts/tune_kernels.py --out "$OUT" 2>&1 | tee "$OUT/tune.log"
      summary+=("tune: see tune.log") ;;
    bench)
      python3 recipes/bench_attention.py --quick --out "$OUT" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.md"
      summary+=("bench: $OUT/bench.md") ;;
    bench_full)
      python3 recipes/bench_attention.py --out "$OUT" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.md"
      summary+=("bench_full: $OUT/bench.md") ;;
    *)
      if [ -f "configs/$step.yaml" ]; then  # a recipe config name: train it
        accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/train.py \
          --config "configs/$step.yaml" --output_dir "$OUT/$step" 2>"$OUT/${step}_progress.log" | tee "$OUT/$step.md"
        summary+=("$step: $OUT/$step.md")
      else
        echo "unknown step $step"; summary+=("$step: unknown")
      fi ;;
  esac
  summary[-1]="${summary[-1]} ($(( $(date +%s) - start )) s)"
done
echo; echo "== gpu_suite summary =="; cat "$OUT/env.txt"; printf '%s\n' "${summary[@]}"
