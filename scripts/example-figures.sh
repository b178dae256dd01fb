#!/usr/bin/env bash
# xeontune against diffusers' unmodified examples/dreambooth/train_dreambooth_lora.py, one time-boxed run
# for a machine held for minutes (docs/performance.md, "Against the unmodified train_dreambooth_lora.py"):
# LoRA, then LoRA with prior preservation, each as the script and as `xeontune train --method lora`,
# then xeontune again on the bf16 copy the first run wrote (a later run), then both on 2 cores with
# oneDNN capped at AVX512-BF16 (ONEDNN_MAX_CPU_ISA: a stand-in for a CPU without AMX). Not by default:
# example_lora_2c and xeontune_lora_2c, the pair on 2 cores uncapped (a 2-core machine of that CPU). Step times come
# from scripts/step-times (the same hook in both programs), peak RSS from scripts/measured_run.py.
# Each run is cut at one deadline, so the earlier figures always come back. Logs go to $OUT.
# Where ./.whl holds wheels and libtcmalloc_minimal.so.4, they are installed to /tmp/site and preloaded.
# Usage: EXAMPLE=path/to/train_dreambooth_lora.py scripts/example-figures.sh [SECONDS_BUDGET]
#   env: RES (512), MP (bf16; the script's --mixed_precision takes EXMP, "no" for fp32), MODEL (sd15-arch),
#   STEPS (steps of every run; default 4-6 each),
#   RUNS (which runs, in order; default all below). SDXL at 1024 px against train_dreambooth_lora_sdxl.py:
#   MODEL=sdxl-arch RES=1024 RUNS="xeontune_lora_first xeontune_lora_later example_lora" EXAMPLE=.../train_dreambooth_lora_sdxl.py
set -u
EXAMPLE=${EXAMPLE:?set EXAMPLE to diffusers examples/dreambooth/train_dreambooth_lora.py}
RUNS=${RUNS:-example_lora xeontune_lora_first example_pp xeontune_pp_first xeontune_lora_later example_lora_avx512bf16_2c xeontune_lora_avx512bf16_2c}
BUDGET=${1:-540}; RES=${RES:-512}; MP=${MP:-bf16}; EXMP=${EXMP:-$MP}; MODEL=${MODEL:-sd15-arch}
START=$(date +%s); DEADLINE=$((START + BUDGET))
export CUDA_VISIBLE_DEVICES= HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false STEP_TIMES=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; L=$OUT/log.txt; W=${WORK:-$(mktemp -d)}
PY=${PY:-python3}; EXPY=${EXPY:-$PY}
export PYTHONPATH=$PWD/scripts/step-times:$PWD
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$L" 2>&1 || { echo "wheels failed" >>"$L"; exit 1; }
  export PYTHONPATH=/tmp/site:$PYTHONPATH LD_PRELOAD=$PWD/.whl/libtcmalloc_minimal.so.4
fi
{ lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Core|Socket|L3'; grep -o -E 'amx_bf16|avx512_bf16' /proc/cpuinfo | sort | uniq -c
  free -g | head -2; sha256sum "$EXAMPLE"
  $PY -c 'import torch,diffusers,transformers,peft,accelerate;print(torch.__version__,diffusers.__version__,transformers.__version__,peft.__version__,accelerate.__version__,torch.get_num_threads())'
} >>"$L" 2>&1
step() {  # step NAME MAX_SECONDS CMD...
  local name=$1 lim=$2 left; shift 2; left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt 25 ] && { echo "== $name skipped: out of time" >>"$L"; return; }
  [ "$lim" -gt "$left" ] && lim=$left
  echo "== $name (limit ${lim}s) $(date +%T): $*" >>"$L"
  $PY scripts/measured_run.py run "$lim" "$@" >>"$L" 2>&1
}
# a WORK folder kept from an earlier call keeps its model and images
[ -e "$W/model/model_index.json" ] || $PY -m xeontune.cli model "$MODEL" "$W/model" >>"$L" 2>&1
[ -d "$W/data" ] || $PY -m xeontune.cli sample-data --count 4 --size "$RES" "$W/data" >>"$L" 2>&1
[ -d "$W/class" ] || $PY -m xeontune.cli sample-data --count 4 --size "$RES" --seed 7 "$W/class" >>"$L" 2>&1
EX=("$EXAMPLE" --pretrained_model_name_or_path "$W/model" --instance_data_dir "$W/data" --instance_prompt "a photo of sks toy"
    --resolution "$RES" --train_batch_size 1 --rank 4 --seed 0 --mixed_precision "$EXMP")
# --no-random-flip as the script (it does not flip): the latent cache then encodes each image once
OURS=(-m xeontune.train --method lora --model "$W/model" --data-dir "$W/data" --instance-prompt "a photo of sks toy"
      --resolution "$RES" --train-batch-size 1 --rank 4 --seed 0 --mixed-precision "$MP" --no-random-flip
      --checkpointing-steps 0 --save-steps 0 --overwrite)
EXPP=(--with_prior_preservation --class_data_dir "$W/class" --class_prompt "a photo of a toy" --num_class_images 4)
OURPP=(--with-prior-preservation --class-data-dir "$W/class" --class-prompt "a photo of a toy" --num-class-images 4)
FIRST=$(mktemp -d); FIRST_PP=$(mktemp -d); FIRST_2C=$(mktemp -d); FIRST_2U=$(mktemp -d)  # empty caches: first runs
for run in $RUNS; do
  case $run in
    example_lora) step "$run" 200 "$EXPY" "${EX[@]}" --max_train_steps ${STEPS:-6} --output_dir "$W/ex1" ;;
    xeontune_lora_first) XEONTUNE_CACHE=$FIRST step "$run" 200 "$PY" "${OURS[@]}" --max-train-steps ${STEPS:-6} --output-dir "$W/o1" ;;
    example_pp) step "$run" 150 "$EXPY" "${EX[@]}" "${EXPP[@]}" --max_train_steps ${STEPS:-5} --output_dir "$W/ex2" ;;
    xeontune_pp_first) XEONTUNE_CACHE=$FIRST_PP step "$run" 120 "$PY" "${OURS[@]}" "${OURPP[@]}" --max-train-steps ${STEPS:-5} --output-dir "$W/o2" ;;
    # a later run: the bf16 copies the first run wrote are mapped, not made
    xeontune_lora_later) XEONTUNE_CACHE=$FIRST step "$run" 150 "$PY" "${OURS[@]}" --max-train-steps ${STEPS:-5} --output-dir "$W/o3" ;;
    example_lora_avx512bf16_2c) ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 OMP_NUM_THREADS=2 \
      step "$run" 170 taskset -c 0,1 "$EXPY" "${EX[@]}" --max_train_steps ${STEPS:-4} --output_dir "$W/ex4" ;;
    xeontune_lora_avx512bf16_2c) ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 OMP_NUM_THREADS=2 XEONTUNE_CACHE=$FIRST_2C \
      step "$run" 170 taskset -c 0,1 "$PY" "${OURS[@]}" --max-train-steps ${STEPS:-4} --output-dir "$W/o4" ;;
    example_lora_2c) OMP_NUM_THREADS=2 step "$run" 170 taskset -c 0,1 "$EXPY" "${EX[@]}" --max_train_steps ${STEPS:-4} --output_dir "$W/ex5" ;;
    xeontune_lora_2c) OMP_NUM_THREADS=2 XEONTUNE_CACHE=$FIRST_2U \
      step "$run" 170 taskset -c 0,1 "$PY" "${OURS[@]}" --max-train-steps ${STEPS:-4} --output-dir "$W/o5" ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
  esac
done
echo "== done after $(( $(date +%s) - START )) s" >>"$L"
$PY scripts/measured_run.py summary "$L" | tee "$OUT/summary.txt"
