#!/usr/bin/env bash
# The fidelity runs of docs/RESULTS.md sections 5 and 6: the published VaSE with each of its settings
# reverted on its own, at budgets 256 and 128 (buffer 64), on 10 GSM8K reasoning traces and 10 text windows; then
# planted value outliers on 5 text windows, with and without planting. Each run resumes if interrupted.
# Usage: benchmarks/fidelity_ablation.sh gsm8k|text|plant     (then: python benchmarks/fidelity_ablation.py DIR...)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE VASE_THREADS=${VASE_THREADS:-1}
VASE=.venv/bin/vase
TEXT=text:../shared/data/text/tinyshakespeare.txt
P=vase:preset=paper
# vase and vase_dkv as they were before they took the published defaults ("former" in the docs; the recorded runs
# were made then and list these under the plain names)
FORMER=vase:guard_sinks=outside:softmax=all:pool_edge=through:pool_order=position
FORMER_DKV=vase_dkv:projection=head
COMMON=$FORMER,$P,$P:guard_sinks=outside,$P:softmax=all,$P:softmax=all:pool_edge=through:pool_order=position
COMMON=$COMMON,$P:pool_order=position,$FORMER_DKV,vase_dkv:preset=paper,snapkv
case "${1:-}" in
  gsm8k) $VASE fidelity --out runs/abl-gsm8k --source gsm8k --prompts 10 --tokens 1024 --budgets 256,128 --ratios "" \
           --policies "$COMMON,$P:prompt=compress" ;;
  text)  $VASE fidelity --out runs/abl-text --source "$TEXT" --prompts 10 --tokens 1024 --budgets 256,128 --ratios "" \
           --policies "$COMMON,snapkv:pool_edge=zero" ;;
  plant) PLANTED=$FORMER,$P,snapkv,h2o,tova,streaming_llm
         $VASE fidelity --out runs/plant-text --source "$TEXT" --prompts 5 --tokens 1024 --budgets 256,128 --ratios "" \
           --policies "$PLANTED" --plant-layers 4,12,20 --plant-tokens 8 --plant-scale 20
         $VASE fidelity --out runs/noplant-text --source "$TEXT" --prompts 5 --tokens 1024 --budgets 256,128 \
           --ratios "" --policies "$PLANTED" ;;
  *) echo "usage: $0 gsm8k|text|plant" >&2; exit 2 ;;
esac
