#!/usr/bin/env bash
# Multi-GPU recipe runs for one device call on a machine of 4 GPUs (2-GPU steps also run on a 2-GPU machine):
#   bash tools/multi_gpu_suite.sh [tests2] [ddp2] [fsdp2] [fsdp4] [balanced2] [balanced4] ...
# tests2: the 2-GPU recipe tests (tests/test_recipes_multiproc.py -m gpu) on GPUs 0,1; where 4 GPUs exist, ddp2
#   runs beside them on GPUs 2,3 (separate NCCL ports).
# ddp2, fsdp2, fsdp4: llama_1b dense and padded_real_lengths, sdpa against fpatch in 4 rounds with the order rotated
#   (recipes/ranking.py), under configs/accelerate/{ddp_2gpu,fsdp2_2gpu,fsdp2_4gpu}.yaml.
# balanced2, balanced4: padded_real_lengths under FSDP2 on 2 or 4 GPUs with each step's rows dealt across the ranks
#   by real tokens (--balance_ranks true), the same rounds.
# Reports go to $WORK/<step>_<config>/ and are packed into $OUT/multi_gpu.tgz after each step; a summary prints last.
set -uo pipefail
OUT=${OUT:-runs/multi_gpu}
WORK=${WORK:-/tmp/multi_gpu}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import datasets" 2>/dev/null; then
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site datasets dill multiprocess \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
ngpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | tee "$WORK/env.txt"

rank() {  # rank NAME GPUS ACCELERATE_CONFIG PORT [recipe options]: in rounds, each of $CONFIGS (default llama_1b
  # dense, then padded_real_lengths)
  local name=$1 gpus=$2 acc=$3 port=$4 config impls
  shift 4
  for config in ${CONFIGS:-llama_1b padded_real_lengths}; do
    impls=sdpa,fpatch; [ $config = padded_real_lengths ] && impls=sdpa,fpatch,fpatch_pf
    CUDA_VISIBLE_DEVICES=$gpus accelerate launch --config_file "configs/accelerate/$acc.yaml" \
      --main_process_port "$port" recipes/train.py --config "configs/$config.yaml" --implementations $impls \
      --rounds 4 --steps 5 --warmup_steps 3 --plots false --output_dir "$WORK/${name}_$config" "$@" \
      > "$WORK/${name}_$config.md" 2> "$WORK/${name}_$config.log"
    echo "${name} $config: exit $?" >> "$WORK/summary.txt"
  done
}

for step in ${*:-tests2 fsdp2 fsdp4}; do
  start=$(date +%s)
  case $step in
    tests2)
      if [ "$ngpus" -ge 4 ]; then rank ddp2 2,3 ddp_2gpu 29611 & fi
      CUDA_VISIBLE_DEVICES=0,1 python3 -m pytest -m gpu tests/test_recipes_multiproc.py -q -rf -p no:cacheprovider \
        > "$WORK/tests2.log" 2>&1
      echo "tests2: $(tail -n 1 "$WORK/tests2.log")" >> "$WORK/summary.txt"
      wait ;;
    ddp2) rank ddp2 0,1 ddp_2gpu 29612 ;;
    fsdp2) rank fsdp2 0,1 fsdp2_2gpu 29613 ;;
    fsdp4) rank fsdp4 0,1,2,3 fsdp2_4gpu 29614 ;;
    balanced2) CONFIGS=padded_real_lengths rank balanced2 0,1 fsdp2_2gpu 29615 --balance_ranks true ;;
    balanced4) CONFIGS=padded_real_lengths rank balanced4 0,1,2,3 fsdp2_4gpu 29616 --balance_ranks true ;;
    *) echo "$step: unknown step" >> "$WORK/summary.txt" ;;
  esac
  echo "  ($step: $(( $(date +%s) - start )) s)" >> "$WORK/summary.txt"
  cp results/history.csv "$WORK/history.csv" 2>/dev/null
  tar czf "$OUT/multi_gpu.tgz" -C "$WORK" .
done
echo; echo "== multi_gpu_suite summary =="; cat "$WORK/env.txt" "$WORK/summary.txt"
grep -E "^FAILED|^ERROR" "$WORK/tests2.log" 2>/dev/null | head
for f in "$WORK"/*.md; do echo; echo "### $(basename "$f")"; sed -n "/^| implementation/,\$p" "$f"; done
