#!/usr/bin/env bash
# Issue 58 (GPU round four) on one lent GPU, its list in order, under one deadline (each part takes what is left):
#   bash benchmarks/gpu_round4.sh check 500  # 1: make gpu-check whole, its default budget (480 s): a call of its own
#   bash benchmarks/gpu_round4.sh rest 400   # 2: FSDP2 one rank (full, compiled) at batch 32 and 16 with profiles
#                                            # (and 16 with parallel.wrap=block: issue 56's A/B),
#                                            # one process at 32 beside it; 3: fp8 vs bf16 on a Llama-3-8B-shaped
#                                            # body of 8 blocks (compile=blocks; fp8's first compile takes > 1 min)
#   bash benchmarks/gpu_round4.sh fsdp 200   # item 2 alone;  ... llama 200: item 3 alone
# On 2026-11-28 (an H200) `all 575` gave gpu_check 365 s, too few: its side-by-side checks took 240 s, so the
# timed stages were cut; FSDP and the Llama pair needed two more calls on the warm machine. 15 minutes of device
# time hold a machine's start, `check` and most of `rest`.
# Run from the repository root with the wheels the image lacks in .whl (torchao 0.18.0, bitsandbytes 0.50.2) and
# omegaconf 2.4.0 with antlr4 4.9.3 in .site (`pip install --no-deps --target .site ...`; 2.3.0 refuses the
# schema's Union[str, list[str]]). Set SHARDLM_COMMIT to the commit measured. Results land in $OUT: gpu_check.json and
# its log, ab.jsonl (one line per variant), ab.log, smi.csv (nvidia-smi every second).
set -u
what=${1:?check, rest, fsdp or llama}
end=$((SECONDS + ${2:-575}))
left() { echo $((end - SECONDS)); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/.site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit,memory.total --format=csv,noheader
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,power.draw,memory.used --format=csv,noheader -l 1 \
  > "$OUT/smi.csv" 2>&1 &
ab() {  # gpu_ab.py variants ($1) within $2 s, extra arguments after
  local only=$1 budget=$2
  shift 2
  (cd benchmarks && timeout $((budget + 30)) python3 gpu_ab.py --out "$OUT/ab.jsonl" --budget-s "$budget" \
    --only "$only" "$@") 2>&1 | tee -a "$OUT/ab.log" | grep -v '^{'
}
if [ "$what" = check ]; then
  timeout $(($(left) - 5)) python3 benchmarks/gpu_check.py --budget-s $(($(left) - 15)) --out "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log" | grep -v '^{' | tail -30
fi
if [ "$what" = rest ] || [ "$what" = fsdp ]; then
  ab both,fsdp1,fsdp1_b16,fsdp1_b16_block $(($(left) - $([ "$what" = rest ] && echo 150 || echo 10)))
fi
if [ "$what" = rest ] || [ "$what" = llama ]; then
  ab llama_bf16,llama_fp8 $(($(left) - 10)) --steps 10 --warmup 3
fi
kill %1 2>/dev/null
ls -la "$OUT"
