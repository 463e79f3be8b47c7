#!/usr/bin/env bash
# The CUDA tests and the GPU benchmark, on a machine with an NVIDIA GPU and its own torch (>= 2.11).
#
#   scripts/gpu_check.sh [OUT_DIR]          (default out/gpu)
#
# kvtier runs from this checkout with the machine's torch (nothing is installed over it). Python
# packages the machine lacks can be brought as wheel files in .whl/ (gguf, redis, crc32c, blake3, llguidance, liburing: see
# docs/benchmarks.md for the download line); they are unpacked into a private directory.
# Environment knobs: MODELS, CONTEXTS, TIERS, MHA_MODEL, MHA_CONTEXTS, BANDWIDTHS, REPEATS, FORWARD_MODELS,
# FORWARD_MODES, FORWARD_PREFILL, FORWARD_CONTINUATION, FORWARD_BATCH, FORWARD_CONTEXT, FORWARD_SAVING_ALL=1,
# SKIP_TESTS=1, PROBES=1 (exactness and the copy and attention candidates, about 60 s), SKIP_BENCH=1,
# SKIP_MHA=1, HF_COMPILED=auto (add HF's torch.compile decode peer to the forward rows: about a
# minute more; off by default so the defaults fit one call),
# COPY_AB=1 (the kv restore again with KVTIER_BATCHED_COPY=0), SKIP_FORWARD=1,
# BLEND=1 (`kvtier bench blend` on random ids laid out as its RAG prompts, ten passages of BLEND_PASSAGE
# tokens, default 600: about 6K tokens; BLEND_MODEL default llama3-8b, BLEND_N questions default 4; about 2 minutes),
# PROFILE=1 (scripts/gpu_profile.py: where a kv restore's, a restoring step's and a saving decode step's
# time goes, about 170 s; PROFILE_TARGETS picks some of "restore restoring saving"; py-spy is used where
# it is on PATH, e.g. from a py-spy wheel in .whl/).
# The defaults (smollm2-shape's forward with saving and restoring rows at batch 1 and 32, exact mode)
# fit one 10-minute call on an H200 (docs/benchmarks.md, "On an NVIDIA H200", has the parts' times).
# The whole forward sweep wants a call of its own:
#   SKIP_TESTS=1 SKIP_BENCH=1 SKIP_MHA=1 HF_COMPILED=auto FORWARD_MODELS="smollm2-shape llama3-8b llama2-7b" \
#     FORWARD_MODES=exact,eager FORWARD_PREFILL=4096,16384 FORWARD_BATCH=1,8,32 scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kvtier-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/kvtier-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export KVTIER_HOME=${KVTIER_HOME:-/tmp/kvtier-home}
status=0

$PY scripts/gpu_env.py "$OUT/env.json" | tee "$OUT/env.log" || status=1

if [ -z "${SKIP_TESTS:-}" ]; then
  $PY -m pytest -m cuda -q -p no:cacheprovider -rs --durations=10 tests/test_cuda.py \
      --junitxml="$OUT/pytest_cuda.xml" 2>&1 | tee "$OUT/pytest_cuda.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${PROBES:-}" ]; then
  # Restores against recompute, bitwise; the copy and paged-attention candidates.
  $PY scripts/gpu_exactness.py "$OUT/exactness.json" 2>&1 | tee "$OUT/exactness.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  $PY scripts/gpu_candidates.py "$OUT/candidates.json" 2>&1 | tee "$OUT/candidates.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${PROFILE:-}" ]; then
  PATH=/tmp/kvtier-site/bin:$PATH $PY scripts/gpu_profile.py "$OUT" ${PROFILE_TARGETS:-restore restoring saving} 2>&1 | tee "$OUT/profile.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ -n "${BLEND:-}" ]; then  # blended restores: TTFT from pinned host memory and a cold disk beside full prefill
  $PY -m kvtier bench blend --device cuda --dtype bf16 --synthetic --model "${BLEND_MODEL:-llama3-8b}" \
      --passage-tokens "${BLEND_PASSAGE:-600}" --n "${BLEND_N:-4}" --speed-n "${BLEND_N:-4}" --max-tokens 8 \
      --link-tokens 8 --ratios 0.15 --store memory:8GB --json "$OUT/blend.json" 2>&1 | tee "$OUT/blend.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

restore() {  # restore() NAME [extra bench args...]: one `kvtier bench restore` run into $OUT/NAME.*
  local name=$1; shift
  $PY -m kvtier bench restore --device cuda --dtype bf16 --tier "${TIERS:-memory}" --bandwidth "${BANDWIDTHS:-none}" \
      --repeats "${REPEATS:-3}" --workdir /tmp/kvtier-restore-work --json "$OUT/$name.json" \
      --markdown "$OUT/$name.md" "$@" 2>&1 | tee "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}
if [ -z "${SKIP_BENCH:-}" ]; then
  restore restore_gpu --model "${MODELS:-llama3-8b}" --context "${CONTEXTS:-8192,16384}" --plot "$OUT/restore_gpu.png"
fi
if [ -z "${SKIP_MHA:-}" ]; then  # HCache's case: the hidden state is half of K+V per token
  restore restore_mha --model "${MHA_MODEL:-llama2-7b}" --context "${MHA_CONTEXTS:-8192}" \
      --methods kv,hidden,bubblefree,auto --no-baselines
fi
if [ -n "${COPY_AB:-}" ]; then  # the staging DMA as plain copies instead of one batched driver call
  KVTIER_BATCHED_COPY=0 restore restore_unbatched --model "${MODELS:-llama3-8b}" --context 8192 --methods kv --no-baselines
fi
if [ -z "${SKIP_FORWARD:-}" ]; then
  # Per shape, prefill beside HF; decode at batch 1, 8 and 32 with 8K contexts beside HF
  # eager and HF with a static cache under torch.compile; every row against the roofline measured in
  # the same run; mode eager = the same engine without static buffers and CUDA graphs. Saving rows
  # and the TBT while contexts restore on the first shape only.
  saving="--saving --restoring"
  for model in ${FORWARD_MODELS:-smollm2-shape}; do
    $PY -m kvtier bench forward --device cuda --dtype bf16 --model "$model" --modes "${FORWARD_MODES:-exact}" \
        --prefill "${FORWARD_PREFILL:-4096}" --continuation "${FORWARD_CONTINUATION:-512}" \
        --batch "${FORWARD_BATCH:-1,32}" --prompt-len "${FORWARD_CONTEXT:-8192}" --new-tokens 32 \
        --repeats "${REPEATS:-3}" --hf-compiled "${HF_COMPILED:-off}" $saving --json "$OUT/forward_$model.json" 2>&1 | tee "$OUT/forward_$model.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    saving=${FORWARD_SAVING_ALL:+--saving --restoring}
  done
fi
exit $status
