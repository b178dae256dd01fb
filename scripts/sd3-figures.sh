#!/usr/bin/env bash
# xeontune against diffusers' unmodified examples/dreambooth/train_dreambooth_lora_sd3.py on sd35m-arch (SD3.5
# Medium's sizes, bf16 files as the hub's) at 512 px: LoRA rank 4, batch 1, the 4 sample images, one prompt
# (docs/performance.md, "SD3.5 Medium-arch LoRA against the unmodified script"). Step times from scripts/step-times
# (the same hook in both programs), peak RSS from scripts/measured_run.py; logs in $OUT.
# Usage: EXAMPLE=path/to/train_dreambooth_lora_sd3.py EXPY=python-with-torchvision scripts/sd3-figures.sh
#   env: WORK (a folder kept between calls: model, images, caches), RES (512), MP (bf16), STEPS (5),
#   LIMIT (seconds per run, 1500), RUNS (in order; default: example xeontune_first xeontune_later),
#   MODEL (sd35m-arch; flux-arch with EXAMPLE=.../train_dreambooth_lora_flux.py).
set -u
EXAMPLE=${EXAMPLE:?set EXAMPLE to diffusers examples/dreambooth/train_dreambooth_lora_sd3.py}
RUNS=${RUNS:-example xeontune_first xeontune_later}
RES=${RES:-512}; MP=${MP:-bf16}; STEPS=${STEPS:-5}; LIMIT=${LIMIT:-1500}; MODEL=${MODEL:-sd35m-arch}
export CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false STEP_TIMES=1
OUT=${OUT:-/tmp/out-sd3}; mkdir -p "$OUT"; L=$OUT/log.txt; W=${WORK:-/tmp/work-sd3}; mkdir -p "$W"
PY=${PY:-.venv/bin/python}; EXPY=${EXPY:-$PY}
export PYTHONPATH=$PWD/scripts/step-times:$PWD
# tcmalloc for the script too, as xeontune preloads it for itself
TCMALLOC=$("$PY" -c 'from xeontune import hardware; print(hardware.libraries().tcmalloc or "")' 2>/dev/null)
{ lscpu | grep -E 'Model name|^CPU\(s\)'; grep -o -E 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort | uniq -c
  free -g | head -2; sha256sum "$EXAMPLE"; echo "tcmalloc: ${TCMALLOC:-none}"
} >>"$L" 2>&1
[ -e "$W/model/model_index.json" ] || "$PY" -m xeontune.cli model "$MODEL" "$W/model" >>"$L" 2>&1
[ -d "$W/data" ] || "$PY" -m xeontune.cli sample-data --count 4 --size "$RES" "$W/data" >>"$L" 2>&1
step() {  # step NAME CMD...
  local name=$1; shift
  echo "== $name (limit ${LIMIT}s) $(date +%T): $*" >>"$L"
  "$PY" scripts/measured_run.py run "$LIMIT" "$@" >>"$L" 2>&1
}
EX=("$EXAMPLE" --pretrained_model_name_or_path "$W/model" --instance_data_dir "$W/data"
    --instance_prompt "a photo of sks toy" --resolution "$RES" --train_batch_size 1 --rank 4 --seed 0
    --mixed_precision "$MP" --checkpointing_steps 100000 --max_train_steps "$STEPS")
OURS=(-m xeontune.train --method lora --model "$W/model" --data-dir "$W/data" --instance-prompt "a photo of sks toy"
      --resolution "$RES" --train-batch-size 1 --rank 4 --seed 0 --mixed-precision "$MP" --no-random-flip
      --checkpointing-steps 0 --save-steps 0 --overwrite --max-train-steps "$STEPS")
FIRST=$(mktemp -d)  # an empty cache: the first run writes what later runs map
for run in $RUNS; do
  case $run in
    example) LD_PRELOAD=$TCMALLOC step "$run" "$EXPY" "${EX[@]}" --output_dir "$W/ex" ;;
    example_cached) LD_PRELOAD=$TCMALLOC step "$run" "$EXPY" "${EX[@]}" --cache_latents --output_dir "$W/exc" ;;
    xeontune_first) rm -rf "$FIRST"; mkdir -p "$FIRST"; XEONTUNE_CACHE=$FIRST step "$run" "$PY" "${OURS[@]}" --output-dir "$W/o1" ;;
    xeontune_later) XEONTUNE_CACHE=$FIRST step "$run" "$PY" "${OURS[@]}" --output-dir "$W/o2" ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
  esac
done
"$PY" scripts/measured_run.py summary "$L" | tee "$OUT/summary.txt"
