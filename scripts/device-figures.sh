#!/usr/bin/env bash
# The figures of docs/performance.md's many-core section (LoRA against the example and against textual
# inversion at 512 px, LoRA with prior preservation, class images against diffusers' pipeline and on 1
# and 3 ranks, SDXL LoRA), as one time-boxed run for a machine held for minutes: each step
# is cut at one deadline so that the earlier, more important figures always come back. Logs and JSON
# go to $OUT (default /tmp/out). Where ./.whl holds wheels (the packages that machine lacks) and
# libtcmalloc_minimal.so.4, they are installed to /tmp/site and preloaded first.
# Usage: scripts/device-figures.sh [SECONDS_BUDGET] [SD_MODEL] [SDXL_MODEL] [RESOLUTION] [CLASS_RESOLUTION]
set -u
BUDGET=${1:-520}; SD15=${2:-sd15-arch}; SDXL=${3:-sdxl-arch}; RES=${4:-512}; CRES=${5:-256}
START=$(date +%s); DEADLINE=$((START + BUDGET))
export CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/log.txt
PY=${PY:-python3}
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$L" 2>&1 || { echo "wheels failed" >>"$L"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  export LD_PRELOAD=$PWD/.whl/libtcmalloc_minimal.so.4
fi
{
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|NUMA node\(s\)|L3'
  grep -o -E 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort | uniq -c
  free -g | head -2; nproc
  $PY -c 'import torch,diffusers,transformers,peft,accelerate;print(torch.__version__,diffusers.__version__,transformers.__version__,peft.__version__,accelerate.__version__,torch.get_num_threads())'
} >>"$L" 2>&1
step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 lim=$2 left; shift 2
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt 20 ] && { echo "== $name skipped: out of time" >>"$L"; return; }
  [ "$lim" -gt "$left" ] && lim=$left
  echo "== $name (limit ${lim}s) $(date +%T): $*" >>"$L"
  timeout -k 5 "$lim" "$@" >>"$L" 2>&1
  echo "== $name rc=$? $(date +%T)" >>"$L"
}
B="$PY -m xeontune.bench"
export XEONTUNE_CACHE=$(mktemp -d)  # first run: no bf16 copy exists yet
step lora "${LORA_S:-230}" $B --method lora --model "$SD15" --resolution "$RES" --steps 4 --warmup 1 \
  --statistic median --ranks-per-node none --json-out "$OUT/lora.json"
step ti "${TI_S:-80}" $B --model "$SD15" --resolution "$RES" --steps 4 --warmup 1 --statistic median \
  --ranks-per-node none --no-baseline --no-rss --json-out "$OUT/ti.json"
step lorapp "${PP_S:-240}" $B --method lora --with-prior-preservation --model "$SD15" --resolution "$RES" --steps 3 \
  --warmup 1 --statistic median --ranks-per-node none --json-out "$OUT/lorapp.json"
step classbench "${CLS_S:-90}" $B --class-images 3 --model "$SD15" --resolution "$CRES" --class-inference-steps 10 \
  --json-out "$OUT/class.json"
$PY -m xeontune.cli sample-data --count 4 --size "$CRES" /tmp/data >>"$L" 2>&1
for n in 3 1; do
  step "classgen$n" "${CLS_S:-90}" $PY -m xeontune.train --method lora --model "models/$SD15" --data-dir /tmp/data \
    --instance-prompt "a photo of sks toy" --with-prior-preservation --class-data-dir "/tmp/class$n" \
    --class-prompt "a photo of a toy" --num-class-images 6 --class-inference-steps 10 --resolution "$CRES" \
    --max-train-steps 1 --checkpointing-steps 0 --save-steps 0 --output-dir "/tmp/o$n" --overwrite --nproc-per-node "$n"
done
grep -h "generated .* class images" "$L" >"$OUT/classgen.txt"
step sdxl "${SDXL_S:-600}" $B --method lora --model "$SDXL" --resolution "$RES" --steps 3 --warmup 1 \
  --statistic median --ranks-per-node none --one-at-a-time --no-rss --json-out "$OUT/sdxl.json"
echo "== done after $(( $(date +%s) - START )) s" >>"$L"
