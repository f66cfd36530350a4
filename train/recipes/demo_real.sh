#!/usr/bin/env bash
# make demo-real: a drafter for a real instruction-tuned target (SmolLM2-135M-Instruct, from
# `make real-target`), trained on the target's own answers and judged in vLLM against vLLM's
# n-gram speculator and plain decoding on GSM8K, HumanEval, MBPP and MT-Bench (docs/real-target.md).
#
#   target/   the target: a hard-linked copy of REAL_TARGET (a transformers folder, converted from GGUF)
#   drafter/  the drafter, exported for vLLM (DFlashDraftModel, or LlamaForCausalLMEagle3 with OBJECTIVE=eagle3)
#   eval-bench.{json,md,png}  the drafter served by vLLM per benchmark, beside the n-gram baseline
#
# Stages, each the product's own command; the intermediate folders stay for inspection:
#   1. prompts     the shipped licence-clean training prompts (prompts.jsonl)
#   2. regenerate  the target writes the answers (regen/): served by vLLM (`vllm serve` through
#                  dflash_prep.engine.with_server, which stops it with the recipe), or in-process
#   3. tokenize    with the target's tokenizer and chat template (data/), analyze (plan/), pack for
#                  the objective (manifests/)
#   4. extract     the target's hidden states, once, in vLLM (states/); the drafter trains from them
#   5. train       the drafter (drafter-run/), then export it (drafter/)
#   6. evaluate    vLLM with and without speculation, per set: strict load, lossless, tau, tokens/s
#
# A rerun resumes: regenerate, tokenize, extract and train recognise their finished output (and
# continue a stopped one), analyze and pack are deterministic and take seconds, export is skipped
# when it is newer than the run, evaluate when it is and its command line is the same as last time.
#
# Knobs (environment): DEMO_REAL (output folder), DEMO_SIZE (default | small: the CI smoke run,
# below), REAL_TARGET (the converted target), PY, OBJECTIVE (dflash | eagle3 | dflash2: vLLM serves
# DFlash2 only on a GPU, so on a CPU-only engine the demo says so and stops), N (prompts per training
# set), REGEN_TOKENS (most tokens per answer), REGEN_CONCURRENCY, REGEN_ENGINE (vllm | hf),
# STATES (1: extract, then train from the cache; 0: the transformers target in the trainer),
# DEVICE (cpu: the trainer's and the in-process regenerate's torch device), B (block size),
# DRAFT_LAYERS, MAX_ANCHORS, DRAFT_STEPS, DRAFT_EPOCHS, BUDGET (tokens per micro-batch), LR (the drafter's
# peak learning rate: 1e-3 for DFlash, the best of five measured on this target, docs/real-target.md#what-moves-tau;
# 3e-3 for EAGLE-3 and DFlash2, not yet measured here),
# BENCH, BENCH_N (prompts per set; 80 = MT-Bench whole), EVAL_TOKENS (new tokens per prompt),
# OURS (1: also our own evaluator's tau per set), BASELINE (the untrained speculator beside the drafter),
# EVAL_EVERY (the learning curve: every N steps the checkpoint is served in vLLM on EVAL_N prompts of
# each benchmark set, beside training, and logged; 0 = off), EVAL_N, FIRST_ANSWER_TOKENS (MT-Bench: the
# target's first answers are complete up to this many tokens before the second turn is asked; evaluate's
# default is 1024 as published, the demo's 256 (SmolLM2 runs on past 1024 tokens in 5 of 8 answers, and
# asking 80 of them again for 1024 tokens would add some 25 minutes on 2 cores), 64 in the smoke run; the
# report counts the answers cut at the cap).
#
# DEMO_SIZE=small (the CI smoke test, tests/engine/test_demo_real.py, <= 4 minutes): 2 prompts per
# set answered in 24 tokens by the in-process transformers target (no server start), 2 drafter steps
# with the target in the trainer (no extract), then the same evaluate on 2 prompts per set in 12
# tokens, without our own evaluator: everything the default does in vLLM except regenerate and extract.
set -euo pipefail

OUT=${DEMO_REAL:-demo-real}
PY=${PY:-python}
REAL_TARGET=${REAL_TARGET:-real-target/target}
OBJECTIVE=${OBJECTIVE:-dflash}
DEMO_SIZE=${DEMO_SIZE:-default}
case "$OBJECTIVE" in dflash|dflash2|eagle3) ;; *) echo "error: OBJECTIVE must be dflash, dflash2 or eagle3, got $OBJECTIVE" >&2; exit 1;; esac
case "$DEMO_SIZE" in
    # sized for about 90 minutes on 2 shared CPU cores from measured stage rates (docs/real-target.md):
    # regenerate ~50k tokens, extract ~70k, 240 drafter steps, 3 vLLM engines x 400 prompts x 32 tokens
    default) : "${N:=80}" "${REGEN_TOKENS:=256}" "${REGEN_ENGINE:=vllm}" "${STATES:=1}" "${DRAFT_STEPS:=240}" \
               "${DRAFT_EPOCHS:=8}" "${MAX_ANCHORS:=64}" "${BENCH_N:=80}" "${EVAL_TOKENS:=32}" "${OURS:=0}" \
               "${EVAL_EVERY:=60}" "${FIRST_ANSWER_TOKENS:=256}" ;;
    # the CI smoke run: what is left is mostly the three engine starts of evaluate
    small)   : "${N:=2}" "${REGEN_TOKENS:=24}" "${REGEN_ENGINE:=hf}" "${STATES:=0}" "${DRAFT_STEPS:=2}" \
               "${DRAFT_EPOCHS:=2}" "${MAX_ANCHORS:=16}" "${BENCH_N:=2}" "${EVAL_TOKENS:=12}" "${OURS:=0}" \
               "${EVAL_EVERY:=0}" "${FIRST_ANSWER_TOKENS:=64}" ;;
    *) echo "error: DEMO_SIZE must be default or small, got $DEMO_SIZE" >&2; exit 1 ;;
esac
REGEN_CONCURRENCY=${REGEN_CONCURRENCY:-64}
B=${B:-8}
case "$OBJECTIVE" in dflash) LR=${LR:-1e-3} ;; *) LR=${LR:-3e-3} ;; esac   # measured for DFlash only
DRAFT_LAYERS=${DRAFT_LAYERS:-1}
BUDGET=${BUDGET:-2048}
BENCH=${BENCH:-all}
BASELINE=${BASELINE:-ngram}
EVAL_N=${EVAL_N:-8}
case "$EVAL_EVERY" in ''|*[!0-9]*) echo "error: EVAL_EVERY must be a whole number of steps, got $EVAL_EVERY" >&2; exit 1;; esac
CURVE_FLAGS=""
[ "$EVAL_EVERY" = 0 ] || CURVE_FLAGS="--eval-every $EVAL_EVERY --eval-bench $BENCH --eval-n $EVAL_N --eval-ours off"
case "$REGEN_ENGINE" in vllm|hf) ;; *) echo "error: REGEN_ENGINE must be vllm or hf, got $REGEN_ENGINE" >&2; exit 1;; esac
case "$STATES" in 0|1) ;; *) echo "error: STATES must be 0 or 1, got $STATES" >&2; exit 1;; esac
case "$OURS" in 0) OURS_FLAG=--no-ours ;; 1) OURS_FLAG=--ours ;; *) echo "error: OURS must be 0 or 1, got $OURS" >&2; exit 1;; esac
# one thread per process: on a small shared machine torch's default (one per core) mostly adds contention
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CLI="$PY -m dflash_prep.cli"
DEVICE=${DEVICE:-cpu}
TRAIN="$PY -m dflash_prep.train --device $DEVICE --no-progress"
# step, claim_folder, vllm_installed, vllm_has_cuda
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [ ! -e "$REAL_TARGET/gguf-target.json" ]; then
    echo "error: no converted target at $REAL_TARGET (gguf-target.json); run make real-target" >&2
    exit 1
fi
if ! vllm_installed; then
    echo "error: demo-real serves its drafter with vLLM and finds none; run make venv-vllm" >&2
    exit 1
fi
if [ "$OBJECTIVE" = dflash2 ] && ! vllm_has_cuda; then
    echo "demo-real skipped: vLLM serves DFlash2 only on its V2 model runner, on a GPU; this vLLM build's torch sees no CUDA"
    exit 0
fi

# resume in place, but only in a folder this recipe made (it leaves a marker file)
claim_folder "$OUT" .demo-real DEMO_REAL
# newer FILE THAN...: FILE exists and is newer than every THAN (a stage whose output is up to date)
newer() { local f=$1; shift; [ -e "$f" ] || return 1; for t in "$@"; do [ "$f" -nt "$t" ] || return 1; done; }

step "0. the target, $REAL_TARGET: $OUT/target"
# hard links (the same files, no copy) where the filesystem allows; convert-gguf replaces a folder
# by renaming a new one into place, so these files never change under the demo
if [ ! -e "$OUT/target/gguf-target.json" ]; then
    rm -rf "$OUT/target.part"
    cp -rl "$REAL_TARGET" "$OUT/target.part" 2>/dev/null || { rm -rf "$OUT/target.part"; cp -r "$REAL_TARGET" "$OUT/target.part"; }
    mv "$OUT/target.part" "$OUT/target"
elif ! cmp -s "$REAL_TARGET/gguf-target.json" "$OUT/target/gguf-target.json"; then
    echo "error: $OUT/target was converted from another GGUF than $REAL_TARGET; set DEMO_REAL to a new folder" >&2
    exit 1
fi
TARGET="$OUT/target"

step "1. training prompts: $N from each of train-math, train-code, train-chat: $OUT/prompts.jsonl"
$CLI prompts --set train-math,train-code,train-chat --n "$N" --out "$OUT/prompts.jsonl"

step "2. the target answers them (greedy, <= $REGEN_TOKENS tokens, $REGEN_ENGINE): $OUT/regen"
REGEN_FLAGS="--max-tokens $REGEN_TOKENS --temperature 0 --out $OUT/regen"
REGEN_DONE=$($PY -c "import json, sys; print(json.load(open(sys.argv[1])).get('complete') is True)" "$OUT/regen/regenerate.json" 2>/dev/null || true)
if [ "$REGEN_ENGINE" = vllm ] && [ "$REGEN_DONE" != True ]; then
    # one `vllm serve` of the target for the whole stage, stopped when regenerate ends (or this script does)
    $PY -m dflash_prep.engine.with_server "$TARGET" --log "$OUT/regen-serve.log" --max-num-seqs "$REGEN_CONCURRENCY" -- \
        $CLI regenerate "$OUT/prompts.jsonl" --base-url "{base_url}/v1" --model "{model}" \
        --concurrency "$REGEN_CONCURRENCY" $REGEN_FLAGS
elif [ "$REGEN_ENGINE" = vllm ]; then
    # finished: regenerate checks its output against these settings and reports it done without
    # contacting a server, so none is started (the address below is never used)
    $CLI regenerate "$OUT/prompts.jsonl" --base-url http://127.0.0.1:9/v1 --model "$TARGET" $REGEN_FLAGS
else
    $CLI regenerate "$OUT/prompts.jsonl" --engine hf --target "$TARGET" --batch-size 8 --device "$DEVICE" $REGEN_FLAGS
fi

step "3. tokenize (the target's chat template), analyze, pack for $OBJECTIVE"
DATA="$OUT/data" PLAN="$OUT/plan/plan.json" MANIFESTS="$OUT/manifests"
$CLI tokenize "$OUT/regen/chat.jsonl" --out "$DATA" --tokenizer "$TARGET" --max-len 2048
$CLI analyze "$DATA" --budget "$BUDGET" --out "$OUT/plan"
case "$OBJECTIVE" in
    # the demo's drafter shape, the same for pack (its cost model) and the trainer
    dflash|dflash2) OBJ_FLAGS="--block-size $B --draft-layers $DRAFT_LAYERS --max-anchors $MAX_ANCHORS" ;;
    eagle3)         OBJ_FLAGS="" ;;   # its defaults: 3 taps, draft vocabulary 32,000, 7 TTT steps
esac
$CLI pack "$DATA" --plan "$PLAN" --epochs 0-$(( DRAFT_EPOCHS - 1 )) --objective "$OBJECTIVE" $OBJ_FLAGS \
    --target-config "$TARGET" --out "$MANIFESTS"

ENGINE_FLAGS=""
if [ "$STATES" = 1 ]; then
    step "4. extract: the target's states for $OBJECTIVE, once, in vLLM (fp32 on CPU): $OUT/states"
    $CLI extract "$DATA" --target "$TARGET" --objective "$OBJECTIVE" $( [ "$OBJECTIVE" = eagle3 ] || echo "--draft-layers $DRAFT_LAYERS" ) \
        --out "$OUT/states" --engine-arg dtype=float32
    ENGINE_FLAGS="--target-engine vllm --states $OUT/states"
else
    echo "(step 4, extract, skipped: STATES=0, the trainer runs the transformers target itself)"
fi

step "5. train the $OBJECTIVE drafter ($DRAFT_STEPS steps at peak lr $LR; resumes from $OUT/drafter-run), then export it: $OUT/drafter"
$TRAIN --objective "$OBJECTIVE" --target "$TARGET" $OBJ_FLAGS --data "$DATA" --plan "$PLAN" \
    --manifests "$MANIFESTS" --out "$OUT/drafter-run" --epochs "$DRAFT_EPOCHS" --max-steps "$DRAFT_STEPS" \
    --lr "$LR" --warmup-steps 5 --optimizer adamw $ENGINE_FLAGS $CURVE_FLAGS
if newer "$OUT/drafter/model.safetensors" "$OUT/drafter-run/summary.json"; then
    echo "$OUT/drafter is up to date"
else
    $PY -m dflash_prep.train.export "$OUT/drafter-run" --out "$OUT/drafter" --overwrite
fi

step "6. evaluate in vLLM: $BENCH, $BENCH_N prompts a set, <= $EVAL_TOKENS tokens, without speculation, with the drafter${BASELINE:+ and with $BASELINE}: $OUT/eval-bench.{json,md,png}"
# vLLM's n-gram speculator as rows of the same table (BASELINE= leaves them out)
BASELINE_FLAGS=${BASELINE:+--baseline $BASELINE}
# up to date: the same command as last time, and its report newer than the drafter
EVAL_CMD=($CLI evaluate --target "$TARGET" --export "$OUT/drafter" $BASELINE_FLAGS --bench "$BENCH" --n "$BENCH_N"
    --max-tokens "$EVAL_TOKENS" --first-answer-tokens "$FIRST_ANSWER_TOKENS" $OURS_FLAG --out "$OUT/eval-bench.json" --save-prompts "$OUT/eval-bench-prompts")
if newer "$OUT/eval-bench.json" "$OUT/drafter/model.safetensors" && [ "$(cat "$OUT/eval-bench.cmd" 2>/dev/null)" = "${EVAL_CMD[*]}" ]; then
    echo "$OUT/eval-bench.json is up to date"
    cat "$OUT/eval-bench.md"
else
    rm -f "$OUT/eval-bench.cmd"
    "${EVAL_CMD[@]}"
    echo "${EVAL_CMD[*]}" > "$OUT/eval-bench.cmd"
fi
if [ "$EVAL_EVERY" != 0 ]; then
    step "the learning curve: vLLM's tau per set every $EVAL_EVERY steps ($EVAL_N prompts a set, from $OUT/drafter-run/log.jsonl): $OUT/curve.md"
    $PY - "$OUT/drafter-run/log.jsonl" "$OUT/curve.md" <<'PYEOF'
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
evals = [r for r in recs if "eval" in r and "tau_engine" in r["eval"]]
other = [f"step {r['global_step']}: {r['eval'].get('skipped') or r['eval'].get('failed')}" for r in recs
         if "eval" in r and "tau_engine" not in r["eval"]]
sets = sorted({s for r in evals for s in r["eval"]["per_set"]})
f = lambda x: "n/a" if x is None else f"{x:.2f}"
rows = ["| step | tau (pooled) | " + " | ".join(sets) + " | trainer's tau | lossless |",
        "|---" * (len(sets) + 4) + "|"]
rows += [f"| {r['global_step']} | {f(r['eval']['tau_engine'])} | "
         + " | ".join(f(r["eval"]["per_set"].get(s, {}).get("tau_engine")) for s in sets)
         + f" | {f(r['eval']['tau_train'])} | {r['eval']['lossless']} |" for r in evals]
text = "\n".join(rows + [f"(not evaluated: {o})" for o in other]) + "\n"
open(sys.argv[2], "w").write(text)
print(text, end="")
PYEOF
fi
step "done: $OUT/target, $OUT/drafter, $OUT/eval-bench.{json,md,png}$( [ "$EVAL_EVERY" = 0 ] || echo ", $OUT/curve.md" )"
