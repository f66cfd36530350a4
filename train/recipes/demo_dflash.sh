#!/usr/bin/env bash
# make demo-dflash: a DFlash drafter for a tiny Qwen3 target, end to end on CPU (<= 15 min, 2 cores).
# make demo-dflash OBJECTIVE=dflash2: the same, then a DFlash2 drafter warm-started from it.
#
#   target/   the target: a tiny Qwen3 (random init, its own BPE tokenizer + ChatML template),
#             then trained briefly as an LM on the demo corpus (a transformers folder)
#   drafter/  the drafter in the public DFlash format (config.json + model.safetensors + export.json);
#             with OBJECTIVE=dflash2 the DFlash2 drafter (DFlash2DraftModel), the DFlash one it
#             started from in drafter-v1/
#   eval.json speculative decoding on held-out prompts: mean acceptance length tau at B, lossless check
#   eval-bench.json/.md/.png  the drafter in vLLM per benchmark (step 10, where vLLM is installed)
#
# Every stage is the product's own command; the intermediate folders stay for inspection
# (corpus/, target0/, lm-data/, lm-plan/, lm-manifests/, lm-run/, drafter-run/; regen/ (the
# target's own answers), data/, plan/, manifests/ for the drafter).
# Knobs (environment): DEMO_DFLASH (output folder), PY, N (training conversations), HELD
# (held-out prompts), B (block size), LM_STEPS, DRAFT_STEPS, DRAFT_LAYERS, MAX_ANCHORS (anchors per
# sample), MAX_NEW (tokens per prompt), REGEN_TOKENS (tokens per regenerated answer),
# LM_EPOCHS / DRAFT_EPOCHS (epochs packed for each run), SLOT_WEIGHTS (decay|dpace), LOSS (ce|kl),
# OPTIMIZER (adamw|muon), TARGET_RANKS (0: the drafter holds the target; K: the drafter stage is
# a torchrun job of K target processes + DRAFTER_RANKS drafter processes, docs/target-ranks.md),
# DRAFTER_RANKS (drafter processes, default 1 with or without TARGET_RANKS, so that TARGET_RANKS
# changes only where the target runs, not the data plan; the manifests are packed for it).
# TARGET_ENGINE (hf: the transformers target; vllm: the DFlash drafter's target in vLLM, beside each
# drafter rank or on the target ranks, one document an engine call, fp32: docs/target-ranks.md).
# ENGINE_EVAL (auto: step 10 runs where vLLM is installed; 1: require it; 0: skip), BENCH (its shipped
# prompt sets) and BENCH_N (prompts from each).
# BASE_ONLY=1 stops after steps 1-5's shared part (the target, corpus, regenerated answers, tokenized
# and planned drafter data; DEMO_DFLASH/base.knobs names the knobs they were made with); BASE_FROM=DIR
# copies that part from such a folder instead of remaking it, when its knobs (N, HELD, LM_STEPS,
# LM_EPOCHS, REGEN_TOKENS, BUDGET, TARGET_ARGS) are this run's: the three objectives on one target
# for the cost of one (refused in one line otherwise).
# OBJECTIVE (dflash | dflash2: DFlash2 warm-started from the DFlash drafter for DRAFT2_STEPS steps,
# on manifests packed for dflash2, with SELECTOR_MISSING (drop|inject) and SELECTOR_ALPHA; eagle3:
# an EAGLE-3 drafter over a DRAFT_VOCAB-id draft vocabulary (64: fewer than the ~90 ids its data trains on, so the
# map is exercised), TTT_STEPS passes, taps EAGLE3_TAPS (a 4-layer target's default taps coincide),
# decoded by chain drafting of TTT_STEPS tokens).
set -euo pipefail

OUT=${DEMO_DFLASH:-demo-dflash}
PY=${PY:-python}
N=${N:-2000}
HELD=${HELD:-32}
B=${B:-8}
LM_STEPS=${LM_STEPS:-400}
LM_EPOCHS=${LM_EPOCHS:-3}
DRAFT_STEPS=${DRAFT_STEPS:-700}
DRAFT_EPOCHS=${DRAFT_EPOCHS:-5}
MAX_ANCHORS=${MAX_ANCHORS:-64}
DRAFT_LAYERS=${DRAFT_LAYERS:-1}
MAX_NEW=${MAX_NEW:-64}
REGEN_TOKENS=${REGEN_TOKENS:-96}
BUDGET=${BUDGET:-2048}
SLOT_WEIGHTS=${SLOT_WEIGHTS:-decay}
LOSS=${LOSS:-ce}
OPTIMIZER=${OPTIMIZER:-adamw}
WINDOW=${WINDOW:-0}
TARGET_RANKS=${TARGET_RANKS:-0}
OBJECTIVE=${OBJECTIVE:-dflash}
DRAFT2_STEPS=${DRAFT2_STEPS:-300}
SELECTOR_MISSING=${SELECTOR_MISSING:-drop}
SELECTOR_ALPHA=${SELECTOR_ALPHA:-1.0}
DRAFT_VOCAB=${DRAFT_VOCAB:-64}
TTT_STEPS=${TTT_STEPS:-7}
EAGLE3_TAPS=${EAGLE3_TAPS:-"0 1 2"}
case "$OBJECTIVE" in dflash|dflash2|eagle3) ;; *) echo "error: OBJECTIVE must be dflash, dflash2 or eagle3, got $OBJECTIVE" >&2; exit 1;; esac
DRAFTER_RANKS=${DRAFTER_RANKS:-1}
TARGET_ENGINE=${TARGET_ENGINE:-hf}
case "$TARGET_ENGINE" in
    hf) ENGINE_FLAGS="" ;;
    vllm) ENGINE_FLAGS="--target-engine vllm --engine-tokens 1 --engine-arg dtype=float32" ;;
    *) echo "error: TARGET_ENGINE must be hf or vllm, got $TARGET_ENGINE" >&2; exit 1 ;;
esac
ENGINE_EVAL=${ENGINE_EVAL:-auto}
BENCH=${BENCH:-gsm8k,humaneval,mt-bench}
BENCH_N=${BENCH_N:-8}
case "$ENGINE_EVAL" in auto|0|1) ;; *) echo "error: ENGINE_EVAL must be auto, 0 or 1, got $ENGINE_EVAL" >&2; exit 1;; esac
BASE_FROM=${BASE_FROM:-}
BASE_ONLY=${BASE_ONLY:-0}
case "$BASE_ONLY" in 0|1) ;; *) echo "error: BASE_ONLY must be 0 or 1, got $BASE_ONLY" >&2; exit 1;; esac
# The target's shape: small enough that one LM step on 2,048 tokens takes about a second on a
# loaded 2-core machine (the LM head dominates: keep the vocabulary small). 4 layers: a
# 1-layer drafter taps layer L//2 = 2.
TARGET_ARGS=${TARGET_ARGS:---vocab-size 512 --hidden 64 --layers 4 --heads 2 --kv-heads 1 --head-dim 32 --intermediate 192}
# what steps 1-5's shared part depends on: a BASE_FROM folder must have been made with exactly these
# (one per line, as base.knobs holds them)
BASE_KNOBS=$(printf '%s\n' "N=$N" "HELD=$HELD" "LM_STEPS=$LM_STEPS" "LM_EPOCHS=$LM_EPOCHS" "REGEN_TOKENS=$REGEN_TOKENS" \
    "BUDGET=$BUDGET" "TARGET_ARGS=$TARGET_ARGS")
BASE_PARTS="target0 corpus target regen data plan"
# one thread per process: on a small shared machine torch's default (one per core) mostly adds
# contention; set OMP_NUM_THREADS to override
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CLI="$PY -m dflash_prep.cli"
TRAIN="$PY -m dflash_prep.train --device cpu --no-progress"
# step, claim_folder, vllm_installed
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

if [ -n "$BASE_FROM" ]; then   # checked before anything of $OUT is touched
    if [ ! -f "$BASE_FROM/base.knobs" ]; then
        echo "error: BASE_FROM=$BASE_FROM holds no finished steps 1-5 of this recipe (no base.knobs); run it" \
            "there first (BASE_ONLY=1 stops after them)" >&2; exit 1
    fi
    differ=()
    while IFS= read -r knob; do   # each of this run's knobs against the line base.knobs holds for it
        there=$(grep -m1 "^${knob%%=*}=" "$BASE_FROM/base.knobs" || true)
        [ -n "$there" ] && there=${there#*=} || there=none
        [ "${knob%%=*}=$there" = "$knob" ] || differ+=("${knob%%=*}: $there there, ${knob#*=} here")
    done <<< "$BASE_KNOBS"
    if [ ${#differ[@]} -gt 0 ]; then
        echo "error: BASE_FROM=$BASE_FROM was made with other knobs: $(IFS=';'; echo "${differ[*]}" | sed 's/;/; /g')." \
            "Set them alike, or leave BASE_FROM out" >&2; exit 1
    fi
    if [ "$(cd "$BASE_FROM" && pwd -P)" = "$(mkdir -p "$OUT" && cd "$OUT" && pwd -P)" ]; then
        echo "error: BASE_FROM=$BASE_FROM is DEMO_DFLASH=$OUT itself, which the run starts by emptying;" \
            "point one of them at another folder" >&2; exit 1
    fi
fi

# start clean, but only ever delete a folder this recipe made (it leaves a marker file)
claim_folder "$OUT" .demo-dflash DEMO_DFLASH
rm -rf "$OUT"
claim_folder "$OUT" .demo-dflash DEMO_DFLASH

DATA="$OUT/data" PLAN="$OUT/plan/plan.json" MANIFESTS="$OUT/manifests"
if [ -n "$BASE_FROM" ]; then
step "1-5. the target, corpus, regenerated answers and drafter data of $BASE_FROM (made with this run's knobs)"
for part in $BASE_PARTS; do cp -r "$BASE_FROM/$part" "$OUT/$part"; done
else

step "1. a tiny Qwen3 target, random init, with its tokenizer and chat template: $OUT/target0"
$PY -m dflash_prep.train.target_init --out "$OUT/target0" $TARGET_ARGS

step "2. the demo corpus: $N conversations to train on, the next $HELD held out as prompts"
$CLI synth --profile mini --n $(( N + HELD )) --out "$OUT/corpus" --overwrite
head -n "$N" "$OUT/corpus/chat.jsonl" > "$OUT/corpus/train.jsonl"
tail -n "$HELD" "$OUT/corpus/chat.jsonl" > "$OUT/corpus/heldout.jsonl"

step "3. train the target briefly as an LM ($LM_STEPS steps, varlen, from the transformers folder)"
$CLI tokenize "$OUT/corpus/train.jsonl" --out "$OUT/lm-data" --tokenizer "$OUT/target0" --max-len 2048
$CLI analyze "$OUT/lm-data" --budget "$BUDGET" --out "$OUT/lm-plan"
$CLI pack "$OUT/lm-data" --plan "$OUT/lm-plan/plan.json" --epochs 0-$(( LM_EPOCHS - 1 )) --layout varlen \
    --out "$OUT/lm-manifests"
$TRAIN --objective lm --init-from "$OUT/target0" --data "$OUT/lm-data" --plan "$OUT/lm-plan/plan.json" \
    --manifests "$OUT/lm-manifests" --out "$OUT/lm-run" --epochs "$LM_EPOCHS" --max-steps "$LM_STEPS" --lr 3e-3 --warmup-steps 10
rm -rf "$OUT/target"
cp -r "$OUT/lm-run/hf" "$OUT/target"

step "4. regenerate the responses with the target (the drafter learns what the target says)"
# the last assistant turn of each conversation, greedy, in-process (batched generate); the
# earlier turns stay as context, and tokenize trains on the regenerated turn only
$CLI regenerate "$OUT/corpus/train.jsonl" --engine hf --target "$OUT/target" --model demo-target \
    --turns last --max-tokens "$REGEN_TOKENS" --batch-size 32 --out "$OUT/regen"

step "5. tokenize, analyze and pack the drafter's data"
$CLI tokenize "$OUT/regen/chat.jsonl" --out "$DATA" --tokenizer "$OUT/target" --max-len 2048 --train-turns last
$CLI analyze "$DATA" --budget "$BUDGET" --out "$OUT/plan"
echo "$BASE_KNOBS" > "$OUT/base.knobs"   # written last: steps 1-5's shared part is whole
if [ "$BASE_ONLY" = 1 ]; then
    step "done (BASE_ONLY=1): $OUT holds steps 1-5's shared part; BASE_FROM=$OUT runs an objective on it"
    exit 0
fi
fi
$CLI pack "$DATA" --plan "$PLAN" --epochs 0-$(( DRAFT_EPOCHS - 1 )) --objective dflash --block-size "$B" \
    --max-anchors "$MAX_ANCHORS" --target-config "$OUT/target" --draft-layers "$DRAFT_LAYERS" \
    --sliding-window "$WINDOW" --world-size "$DRAFTER_RANKS" --out "$MANIFESTS"

DRAFT_TRAIN="$TRAIN"
if [ $(( TARGET_RANKS + DRAFTER_RANKS )) -gt 1 ]; then   # one gloo job: K target + W drafter processes
    DRAFT_TRAIN="$PY -m dflash_prep.train.launch --standalone --nproc_per_node $(( TARGET_RANKS + DRAFTER_RANKS ))
        -m dflash_prep.train --device cpu --no-progress --target-ranks $TARGET_RANKS"
fi
if [ "$OBJECTIVE" != "eagle3" ]; then
step "6. train the drafter on the frozen target ($DRAFT_LAYERS layer(s), B = $B, $DRAFT_STEPS steps, $DRAFTER_RANKS drafter process(es), $TARGET_RANKS target process(es), target in $TARGET_ENGINE)"
# the demo's small settings, passed explicitly: the trainer's dflash defaults are the full recipe
# (B = 16, 5 draft layers, sliding window 2048, D-PACE, Muon), sized for a real target
$DRAFT_TRAIN --objective dflash --target "$OUT/target" --draft-layers "$DRAFT_LAYERS" --block-size "$B" \
    --data "$DATA" --plan "$PLAN" --manifests "$MANIFESTS" --out "$OUT/drafter-run" \
    --epochs "$DRAFT_EPOCHS" --max-steps "$DRAFT_STEPS" --lr 3e-3 --warmup-steps 5 --max-anchors "$MAX_ANCHORS" \
    --slot-weights "$SLOT_WEIGHTS" --loss "$LOSS" --optimizer "$OPTIMIZER" --sliding-window "$WINDOW" $ENGINE_FLAGS

step "7. export it in the public DFlash format: $OUT/drafter"
$PY -m dflash_prep.train.export "$OUT/drafter-run" --out "$OUT/drafter" --overwrite
fi

if [ "$OBJECTIVE" = "dflash2" ]; then
    step "7b. DFlash2: manifests packed for its step cost, then $DRAFT2_STEPS steps warm-started from $OUT/drafter-v1"
    rm -rf "$OUT/drafter-v1"
    mv "$OUT/drafter" "$OUT/drafter-v1"
    $CLI pack "$DATA" --plan "$PLAN" --epochs 0-$(( DRAFT_EPOCHS - 1 )) --objective dflash2 --block-size "$B" \
        --max-anchors "$MAX_ANCHORS" --target-config "$OUT/target" --draft-layers "$DRAFT_LAYERS" \
        --sliding-window "$WINDOW" --world-size "$DRAFTER_RANKS" --out "$OUT/manifests-dflash2"
    $DRAFT_TRAIN --objective dflash2 --init-from-drafter "$OUT/drafter-v1" --target "$OUT/target" \
        --draft-layers "$DRAFT_LAYERS" --block-size "$B" --data "$DATA" --plan "$PLAN" \
        --manifests "$OUT/manifests-dflash2" --out "$OUT/drafter2-run" --epochs "$DRAFT_EPOCHS" \
        --max-steps "$DRAFT2_STEPS" --lr 1e-3 --warmup-steps 5 --max-anchors "$MAX_ANCHORS" \
        --slot-weights "$SLOT_WEIGHTS" --loss "$LOSS" --optimizer "$OPTIMIZER" --sliding-window "$WINDOW" \
        --selector-missing "$SELECTOR_MISSING" --selector-loss-alpha "$SELECTOR_ALPHA"
    $PY -m dflash_prep.train.export "$OUT/drafter2-run" --out "$OUT/drafter" --overwrite
fi

SPEC_ARGS=""
if [ "$OBJECTIVE" = "eagle3" ]; then
    step "6. EAGLE-3: the vocabulary map ($DRAFT_VOCAB of the target's ids) and manifests for its step cost, then $DRAFT_STEPS steps"
    $CLI pack "$DATA" --plan "$PLAN" --epochs 0-$(( DRAFT_EPOCHS - 1 )) --objective eagle3 \
        --draft-vocab-size "$DRAFT_VOCAB" --ttt-steps "$TTT_STEPS" --target-config "$OUT/target" \
        --world-size "$DRAFTER_RANKS" --out "$OUT/manifests-eagle3"
    TAP_FLAGS=$(for t in $EAGLE3_TAPS; do printf -- '--target-layer-ids %s ' "$t"; done)   # a repeated option
    $DRAFT_TRAIN --objective eagle3 --target "$OUT/target" $TAP_FLAGS --data "$DATA" \
        --plan "$PLAN" --manifests "$OUT/manifests-eagle3" --out "$OUT/drafter-run" --epochs "$DRAFT_EPOCHS" \
        --max-steps "$DRAFT_STEPS" --lr 3e-3 --warmup-steps 5 --optimizer "$OPTIMIZER"
    step "7. export it for vLLM and SGLang (LlamaForCausalLMEagle3): $OUT/drafter"
    $PY -m dflash_prep.train.export "$OUT/drafter-run" --out "$OUT/drafter" --overwrite
    SPEC_ARGS="--block-size $(( TTT_STEPS + 1 ))"      # chain drafting of TTT_STEPS tokens per round
fi

step "8. speculative decoding on the $HELD held-out prompts (temperature 0): $OUT/eval.json"
$PY -m dflash_prep.train.speculate --target "$OUT/target" --drafter "$OUT/drafter" \
    --prompts "$OUT/corpus/heldout.jsonl" --out "$OUT/eval.json" --max-new-tokens "$MAX_NEW" $SPEC_ARGS

step "9. targets: tau >= 2.0 (blocks of 8 / chains of 7), lossless, drafter loss falling (a warm start excepted)"
$PY - "$OUT" "$OBJECTIVE" <<'PYEOF'
import json, sys
out, objective = sys.argv[1], sys.argv[2]
ev = json.load(open(f"{out}/eval.json"))
run = json.load(open(f"{out}/{'drafter2-run' if objective == 'dflash2' else 'drafter-run'}/summary.json"))
ok = {"tau >= 2.0": ev["tau"] >= 2.0, "lossless": ev["lossless"] is True and
      all(v["lossless"] is True for v in ev["variants"].values())}
if objective != "dflash2":      # a warm start begins near its floor
    ok["loss fell"] = bool(run["loss_fell"])
print(f"{ev['drafter']['architecture']} ({ev['drafter']['proposer']}): tau {ev['tau']:.3f} (pooled {ev['tau_pooled']:.3f}) "
      f"at B = {ev['block_size']} on {ev['prompts']['n']} held-out prompts; lossless {ev['lossless']}; drafter loss "
      f"{run['loss_first']:.3f} -> {run['loss_last']:.3f}")
for name, v in ev["variants"].items():
    print(f"  {name}: tau {v['tau']:.3f} (pooled {v['tau_pooled']:.3f}), lossless {v['lossless']}")
print("  ".join(f"{k}: {'ok' if v else 'MISSED'}" for k, v in ok.items()))
sys.exit(0 if all(ok.values()) else 1)
PYEOF

# 10. the drafter served by vLLM, per benchmark: the table and picture users judge drafters by.
# On this tiny target it checks the plumbing only: a target trained for minutes on a synthetic corpus
# says nothing about a real drafter's tau on these benchmarks.
SKIP_WHY="ENGINE_EVAL=0"
if [ "$ENGINE_EVAL" = auto ]; then
    if vllm_installed; then ENGINE_EVAL=1; else
        ENGINE_EVAL=0 SKIP_WHY="no vLLM (make venv-vllm, or ENGINE_EVAL=1 to require it)"; fi
fi
# DFlash2 needs vLLM's V2 model runner, which needs CUDA: ask the engine's own torch (engine_cuda)
if [ "$ENGINE_EVAL" = 1 ] && [ "$OBJECTIVE" = dflash2 ] && ! $PY -c "import sys; from dflash_prep.engine.env import engine_cuda; sys.exit(0 if engine_cuda('vllm') else 1)" 2>/dev/null; then
    ENGINE_EVAL=0 SKIP_WHY="vLLM serves DFlash2 only on its V2 model runner, on a GPU; this vLLM build's torch sees no CUDA"
fi
if [ "$ENGINE_EVAL" = 1 ]; then
    step "10. vLLM per benchmark ($BENCH, $BENCH_N prompts each, and the held-out set): $OUT/eval-bench.{json,md,png}"
    echo "(a check of the plumbing on a tiny target trained for minutes: these tau values say nothing about a real drafter)"
    $CLI evaluate --target "$OUT/target" --export "$OUT/drafter" --bench "$BENCH" --n "$BENCH_N" \
        --prompts "$OUT/corpus/heldout.jsonl" --max-tokens "$MAX_NEW" --out "$OUT/eval-bench.json" \
        --save-prompts "$OUT/eval-bench-prompts"
else
    echo
    echo "(step 10, vLLM per benchmark, skipped: $SKIP_WHY)"
fi
step "done: $OUT/target, $OUT/drafter, $OUT/eval.json$([ "$ENGINE_EVAL" = 1 ] && echo ", $OUT/eval-bench.{json,md,png}")"
