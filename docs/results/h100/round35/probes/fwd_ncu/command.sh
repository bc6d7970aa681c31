export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; unset TRITON_INTERPRET
mkdir -p $OUT/ncu
for s in c4k f4k; do
  ncu --clock-control none --kernel-name regex:attn_fwd --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section Occupancy --section LaunchStats -o /tmp/fwd_$s python3 scripts/ncu_drive.py --shape $s > /tmp/ncu_$s.log 2>&1 || tail -20 /tmp/ncu_$s.log
  ncu -i /tmp/fwd_$s.ncu-rep --page details > $OUT/ncu/fwd_${s}_details.txt 2>&1
  ncu -i /tmp/fwd_$s.ncu-rep --page source --csv --print-source sass > /tmp/fwd_${s}_sass.csv 2>&1
  python3 scripts/ncu_stalls.py /tmp/fwd_${s}_sass.csv --top 40 > $OUT/ncu/fwd_${s}_stalls.txt 2>&1
  gzip -c /tmp/fwd_${s}_sass.csv > $OUT/ncu/fwd_${s}_sass.csv.gz
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Executed Ipc|Issue Slots Busy|Achieved Occupancy" $OUT/ncu/fwd_${s}_details.txt | head -12
  head -30 $OUT/ncu/fwd_${s}_stalls.txt
done
ls -la $OUT/ncu
