#!/usr/bin/env bash
# Issue 44 (GPU round three) on one lent GPU, in two calls of the device tool, each under its 10-minute cap:
#   bash benchmarks/gpu_round3.sh check   # item 1: make gpu-check whole; item 2: fp8 vs bf16 at XL, compile=blocks
#   bash benchmarks/gpu_round3.sh fsdp S  # item 3: FSDP2 one rank (full, compiled) at batch 16 and 32 with its
#                                         # profile, one process at 32 beside it; item 7: a short run's plots (S s)
# Run from a clean `git archive` of the commit measured (the device copies the working tree as it is) with the
# wheels the image lacks in .whl (torchao 0.18.0, bitsandbytes 0.50.2) and omegaconf 2.4.0 (pip install --target
# .site; 2.3.0 refuses the schema's Union[str, list[str]]) in .site. Results land in $OUT. On an H100 the tests stage
# alone takes ~216 s: give gpu_check its default budget (480 s) in a call of its own to reach throughput and vs_hf.
set -u
what=${1:?check or fsdp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ../.whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$(cd .. && pwd)/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv,noheader \
  | tee -a "$OUT/smi.txt"
case $what in
  check)
    timeout 345 python3 benchmarks/gpu_check.py --budget-s 335 --out "$OUT/gpu_check.json" 2>&1 \
      | tee "$OUT/gpu_check.log" | grep -v '^{' | tail -40
    (cd benchmarks && timeout 215 python3 gpu_ab.py --out "$OUT/xl.jsonl" --budget-s 210 \
      --only xl_fp8_blocks,xl_bf16_blocks 2>&1 | tee "$OUT/xl.log")
    ;;
  fsdp)
    budget=${2:-200}
    (cd benchmarks && python3 gpu_ab.py --out "$OUT/fsdp.jsonl" --budget-s $((budget - 40)) --batch 16 --only fsdp1 \
      && python3 gpu_ab.py --out "$OUT/fsdp.jsonl" --budget-s $((budget - 100)) --batch 32 --only both,fsdp1) 2>&1 \
      | tee "$OUT/fsdp.log"
    run=/tmp/plotrun
    timeout 60 python3 -m shardlm train out_dir=$run train.max_steps=300 train.log_every=10 train.eval_every=100 \
      model.n_layer=8 model.n_embd=512 model.n_head=8 data.seq_len=128 parallel.compile=false 2>&1 | tail -5
    python3 -m shardlm plot $run 2>&1 | tail -3
    cp $run/plots/gpu_utilization.png $run/plots/memory.png "$OUT/" 2>/dev/null
    tar czf "$OUT/plotrun.tgz" -C /tmp plotrun/plots plotrun/metrics.jsonl plotrun/config.yaml 2>/dev/null
    ;;
esac
ls -la "$OUT"
