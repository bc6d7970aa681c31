#!/usr/bin/env bash
# The GPU session in one call: GPU tests, kernel tuning, benchmarks, recipes. A short summary prints last.
#   bash tools/gpu_suite.sh [tests | tests1 tests2 | tests_par] [tune] [tune_fwd] [tune_dropout]
#       [bench | bench_full] [bench_table]
#       [host] [padded] [parity] [parity_dropout] [<config name>] ...
#   (tests1, tests2: each half of the GPU tests, for two calls)
#   PARITY_SEEDS="0 1 2" repeats parity_dropout per seed.
# Logs and reports go to $WORK; after every step they are packed into $OUT/suite.tgz (the device tool returns at
# most 8 files, and a run cut off by its time limit still returns what was packed). On the device machine, carry
# .whl (datasets, dill, multiprocess wheels: see docs/recipes.md).
set -uo pipefail
OUT=${OUT:-runs/gpu_suite}
WORK=${WORK:-/tmp/gpu_suite}
mkdir -p "$OUT" "$WORK"
steps=${*:-tests bench}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site datasets dill multiprocess \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers, accelerate; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"
  python3 -c "import datasets, pyarrow; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)" || echo "datasets import failed"
} 2>&1 | tee "$WORK/env.txt"

train() {  # train NAME CONFIG [overrides...]
  local name=$1 config=$2; shift 2
  accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/train.py --config "configs/$config.yaml" \
    --output_dir "$WORK/$name" "$@" 2>"$WORK/${name}_progress.log" | tee "$WORK/$name.md"
}

summary=()
for step in $steps; do
  start=$(date +%s)
  case $step in
    tests)
      python3 -m pytest -m gpu tests -q -rs -rP -p no:cacheprovider --durations=15 2>&1 | tee "$WORK/pytest_gpu.log"
      summary+=("tests: $(tail -n 1 "$WORK/pytest_gpu.log")") ;;
    tests1|tests2)  # one half of the GPU tests in collection order: the whole set runs past one device call's 10 min
      mapfile -t ids < <(python3 -m pytest -m gpu tests --co -q -p no:cacheprovider 2>/dev/null | grep "::")
      half=$(( (${#ids[@]} + 1) / 2 ))
      if [ "$step" = tests1 ]; then part=("${ids[@]:0:$half}"); else part=("${ids[@]:$half}"); fi
      python3 -m pytest -q -rs -p no:cacheprovider --durations=10 "${part[@]}" 2>&1 | tee "$WORK/pytest_gpu_$step.log"
      summary+=("$step (${#part[@]} of ${#ids[@]}): $(tail -n 1 "$WORK/pytest_gpu_$step.log")") ;;
    tests_par)  # every GPU test in $JOBS (3) pytest processes at once, cases dealt in turn: compiling dominates, and
      # the 16 host cores compile side by side while the GPU runs the others' cases
      mapfile -t ids < <(python3 -m pytest -m gpu tests --co -q -p no:cacheprovider 2>/dev/null | grep "::")
      jobs=${JOBS:-3}
      for ((j = 0; j < jobs; j++)); do
        part=(); for ((i = j; i < ${#ids[@]}; i += jobs)); do part+=("${ids[$i]}"); done
        timeout "${PAR_TIMEOUT:-3000}" python3 -m pytest -q -rf -p no:cacheprovider "${part[@]}" > "$WORK/pytest_gpu_par$j.log" 2>&1 &
      done
      wait
      for ((j = 0; j < jobs; j++)); do
        summary+=("tests_par $j: $(tail -n 1 "$WORK/pytest_gpu_par$j.log")")
        grep -E "^FAILED|^ERROR" "$WORK/pytest_gpu_par$j.log" | head -20
      done ;;
    tune)
      python3 benchmarks/tune_kernels.py --out "$WORK" 2>&1 | tee "$WORK/tune.log"
      summary+=("tune: tune.log") ;;
    tune_fwd)  # forward grid only: d128 at the headline table's lengths, d64 n8192, dropout n8192
      { python3 benchmarks/tune_kernels.py --headdim 128 --seqlens 4096,8192,16384 --skip-bwd --out "$WORK/tune_fwd128"
        python3 benchmarks/tune_kernels.py --headdim 64 --seqlens 8192 --skip-bwd --out "$WORK/tune_fwd64"
        python3 benchmarks/tune_kernels.py --dropout 0.1 --seqlens 8192 --skip-bwd --out "$WORK/tune_fwd_dropout"
      } 2>&1 | tee "$WORK/tune_fwd.log"
      summary+=("tune_fwd: tune_fwd.log") ;;
    tune_dropout)  # dropout 0.1 tiles at d128 n8192 (causal and full)
      python3 benchmarks/tune_kernels.py --dropout 0.1 --seqlens 8192 --out "$WORK/tune_dropout" 2>&1 \
        | tee "$WORK/tune_dropout.log"
      summary+=("tune_dropout: tune_dropout.log") ;;
    bench|bench_full)  # quick: N = 4k; full: 1k..16k
      case $step in
        bench) args="--quick" ;;
        bench_full) args="" ;;
      esac
      python3 benchmarks/bench_attention.py $args --out "$WORK" 2>"$WORK/bench_progress.log" | tee "$WORK/bench.md"
      cp "$WORK/bench.md" "$OUT/bench.md"
      summary+=("$step: bench.md") ;;
    bench_table)  # the README's table (results/latest/bench_attention.md): both commands, in one call
      python3 benchmarks/bench_attention.py --seqlens 4096,8192 --peers fpatch,sdpa_cudnn,flex \
        --match "d128 causal N=4096|d128 causal N=8192|d128 full N=8192|d64 causal N=4096|ALiBi|d128 window|softcap|d256|varlen 73|varlen GQA 16/8" \
        --out "$WORK/table_peers" 2>"$WORK/bench_progress.log" | tee "$WORK/table_peers.md"
      python3 benchmarks/bench_attention.py --seqlens 1000,1024,2048,4000,4096,8000,8191,8192 --peers fpatch,sdpa_cudnn \
        --match "d128 causal N=|d128 full N=4096|d64 causal N=8192|d64 full N=4096|d64 full N=8192|GQA 16/4|GQA 12/4|dropout0.1 N=" \
        --out "$WORK/table_cudnn" 2>>"$WORK/bench_progress.log" | tee "$WORK/table_cudnn.md"
      summary+=("bench_table: table_peers.md, table_cudnn.md") ;;
    host)  # host time per forward + backward against SDPA (results/latest/host_time.md)
      python3 benchmarks/host_time.py --out "$WORK" 2>"$WORK/host_progress.log" | tee "$WORK/host_time.md"
      summary+=("host: host_time.md") ;;
    padded)  # a padded batch through a transformers layer: dense, unpadded, the rule, sdpa (GPU time)
      python3 benchmarks/padded_layer.py --out "$WORK" 2>"$WORK/padded_progress.log" | tee "$WORK/padded_layer.md"
      summary+=("padded: padded_layer.md") ;;
    parity)  # ~100M model, bf16, 200 steps, eager against flashpatch, loss curves in one PNG
      train parity llama_125m --implementations eager,fpatch --data_mode dense --batch_size 4 --steps 200 \
        --warmup_steps 5
      summary+=("parity: parity.md") ;;
    parity_dropout)  # the same with attention dropout 0.1, once per seed in $PARITY_SEEDS (init, data and masks)
      for seed in ${PARITY_SEEDS:-0}; do
        train "parity_dropout_s$seed" llama_125m --implementations eager,fpatch --data_mode dense --batch_size 4 \
          --steps 200 --warmup_steps 5 --attention_dropout 0.1 --seed "$seed"
      done
      python3 tools/dropout_parity.py "$WORK"/parity_dropout_s*/results.json 2>&1 | tee "$WORK/parity_dropout.md"
      summary+=("parity_dropout: parity_dropout.md") ;;
    *)
      if [ -f "configs/$step.yaml" ]; then
        train "$step" "$step"
        summary+=("$step: $step.md")
      else
        summary+=("$step: unknown step")
      fi ;;
  esac
  summary[-1]="${summary[-1]} ($(( $(date +%s) - start )) s)"
  printf '%s\n' "${summary[@]}" > "$WORK/summary.txt"
  cp results/history.csv "$WORK/history.csv" 2>/dev/null  # the rows this run appended come back in suite.tgz
  tar czf "$OUT/suite.tgz" -C "$WORK" .
done
echo; echo "== gpu_suite summary =="; cat "$WORK/env.txt" "$WORK/summary.txt"
for f in "$WORK"/*.md; do [ -f "$f" ] && { echo; echo "### $(basename "$f")"; tail -n 12 "$f"; }; done
