set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 || exit 1
unset TRITON_INTERPRET
R=$PWD; mkdir -p $OUT/ab
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee $OUT/ab/gpu.txt
for rep in 1 2; do
  for t in r31 head; do
    if [ $t = head ]; then d=$R; else d=$R/runs/trees/$t; fi
    python3 scripts/varlen_kernel_times.py --tree $d --label $t --kv-heads 4 --repeats 3 2>&1 | tail -12 | tee $OUT/ab/kt_${t}_$rep.log
  done
done
for rep in 1 2; do
  for t in r31 head; do
    if [ $t = head ]; then d=$R; else d=$R/runs/trees/$t; fi
    (cd $d && accelerate launch --config_file $R/configs/accelerate/single_gpu.yaml recipes/train.py --config configs/padded_real_lengths.yaml --implementations fpatch --output_dir /tmp/ab_${t}_$rep 2>/tmp/ab_${t}_$rep.err | tail -3 | tee $OUT/ab/recipe_${t}_$rep.md) || tail -20 /tmp/ab_${t}_$rep.err
  done
done
echo "== table"; for f in $OUT/ab/recipe_*.md; do echo "$f $(grep '^| fpatch' $f)"; done
