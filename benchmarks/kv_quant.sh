#!/usr/bin/env bash
# The runs of docs/RESULTS.md "Quantize what is kept, protect what is large": evict-only, quantize-only and
# evict + quantize at equal KV bytes (byte ratios 8 and 16 against the full cache in float32), buffer 32, on 10 GSM8K
# reasoning traces and 10 text windows of 1,024 tokens; the same with planted value outliers; transformers'
# QuantizedCache (optimum-quanto) on the same sources; the full-precision window (kv_window) against today's rule;
# decode cost side by side. Each run resumes if interrupted.
# Usage: benchmarks/kv_quant.sh gsm8k|text|plant-gsm8k|plant-text|window-gsm8k|window-text|hf|bench
#        (then: python benchmarks/kv_quant_table.py runs/kvq-gsm8k runs/kvq-text)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE VASE_THREADS=${VASE_THREADS:-1}
VASE=.venv/bin/vase
TEXT=text:../shared/data/text/tinyshakespeare.txt
G=guard=range:protect_share=0.05:protect_precision=guard  # a 5% value guard that also keeps its entries unquantized
VG=protect_precision=guard:protect_share=0.05              # vase has its guard: the same 5%
EVICT=vase,h2o,snapkv
QUANT=full:kv_bits=8,full:kv_bits=4,full:kv_bits=2,full:kv_bits=8:$G,full:kv_bits=4:$G
BOTH=vase:kv_bits=8,vase:kv_bits=4,vase:kv_bits=2,vase:kv_bits=8:$VG,vase:kv_bits=4:$VG
BOTH=$BOTH,h2o:kv_bits=8,h2o:kv_bits=4,h2o:kv_bits=8:$G,h2o:kv_bits=4:$G
BOTH=$BOTH,snapkv:kv_bits=8,snapkv:kv_bits=4,snapkv:kv_bits=8:$G,snapkv:kv_bits=4:$G
ALL=$EVICT,$QUANT,$BOTH
PLANTED=vase,h2o,full:kv_bits=4,full:kv_bits=4:$G,vase:kv_bits=4,vase:kv_bits=4:$VG,h2o:kv_bits=4,h2o:kv_bits=4:$G
PLANT=(--plant-layers 4,12,20 --plant-tokens 8 --plant-scale 20)
WINDOW=vase:kv_bits=4,vase:kv_bits=4:kv_window=16,vase:kv_bits=4:kv_window=32,vase:kv_bits=8,vase:kv_bits=8:kv_window=32
COMMON=(--prompts 10 --tokens 1024 --buffer 32)
case "${1:-}" in
  gsm8k) $VASE fidelity --out runs/kvq-gsm8k --source gsm8k "${COMMON[@]}" --byte-ratios 8,16 --policies "$ALL" ;;
  text)  $VASE fidelity --out runs/kvq-text --source "$TEXT" "${COMMON[@]}" --byte-ratios 8,16 --policies "$ALL" ;;
  plant-gsm8k)
         # the traces of the gsm8k run when it exists (else this run generates the same ones itself)
         mkdir -p runs/kvq-plant-gsm8k
         if [ -f runs/kvq-gsm8k/sources.jsonl ]; then cp -n runs/kvq-gsm8k/sources.jsonl runs/kvq-plant-gsm8k/; fi
         $VASE fidelity --out runs/kvq-plant-gsm8k --source gsm8k "${COMMON[@]}" --byte-ratios 8,16 \
           --policies "$PLANTED" "${PLANT[@]}" ;;
  plant-text)
         $VASE fidelity --out runs/kvq-plant-text --source "$TEXT" "${COMMON[@]}" --byte-ratios 8,16 \
           --policies "$PLANTED" "${PLANT[@]}" ;;
  window-gsm8k)
         $VASE fidelity --out runs/kvw-gsm8k --source gsm8k "${COMMON[@]}" --byte-ratios 8,16 --policies "$WINDOW" ;;
  window-text)
         $VASE fidelity --out runs/kvw-text --source "$TEXT" "${COMMON[@]}" --byte-ratios 8,16 --policies "$WINDOW" ;;
  hf)    for run in runs/kvq-gsm8k runs/kvq-text; do
           .venv/bin/python benchmarks/hf_quantized_fidelity.py "$run" --nbits 4,2 --group 32
         done ;;
  bench) VASE_THREADS=2 $VASE bench paired --out runs/kvq-bench --context 4096 --steps 256 --buffer 32 \
           --budget 1024 --policies \
           full,vase,vase:kv_bits=8,vase:kv_bits=4,vase:kv_bits=4:$VG,h2o,h2o:kv_bits=4,full:kv_bits=4 ;;
  *) echo "usage: $0 gsm8k|text|plant-gsm8k|plant-text|window-gsm8k|window-text|hf|bench" >&2; exit 2 ;;
esac
