set -o pipefail; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 1; unset TRITON_INTERPRET
i=0; for order in fpatch,sdpa sdpa,fpatch fpatch,sdpa sdpa,fpatch; do i=$((i+1)); timeout 140 accelerate launch --config_file configs/accelerate/single_gpu.yaml recipes/train.py --config configs/llama_1b.yaml --implementations $order --steps 30 --plots false --output_dir $OUT/r$i > $OUT/r$i.md 2>/dev/null; done
python3 - <<'P'
import json,os,statistics as st
for i in range(1,5):
    f=os.environ['OUT']+f'/r{i}/results.json'
    if not os.path.exists(f): print(i,'missing'); continue
    d=json.load(open(f)); rs=d['results']
    s=' | '.join(f"{r['implementation']} {r['tokens_per_s']:.0f} med {r['step_time_ms_median']:.1f} first10 {st.mean(r['step_times_ms'][:10]):.1f} last10 {st.mean(r['step_times_ms'][-10:]):.1f}" for r in rs if r['status']=='ok')
    t={r['implementation']:r['tokens_per_s'] for r in rs if r['status']=='ok'}
    print(f"run {i}: {s} | fpatch/sdpa {t.get('fpatch',0)/t.get('sdpa',1):.4f}")
P
