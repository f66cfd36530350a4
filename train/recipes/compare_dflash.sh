#!/usr/bin/env bash
# compare_dflash.sh: drafter recipe variants on the CPU demo's target, at equal steps and seeds.
#
# Needs a demo folder made by train/recipes/demo_dflash.sh (its target, its drafter data, plan and
# manifests, its held-out prompts). For each variant "slot_weights,loss,optimizer" it trains a
# drafter from scratch with the demo's small settings (B, one draft layer, its anchors, lr, init seed SEED),
# exports it, runs speculative decoding on the held-out prompts (temperature 0), and prints one
# markdown table: held-out tau, the training tau and loss of the last 5 steps, and the step time.
# The loss is each variant's own objective (CE or KL, decay- or D-PACE-weighted), so it compares
# only within one loss and weighting; tau compares across all.
# Knobs (environment): DEMO_DFLASH (the demo folder), PY, STEPS, B, DRAFT_LAYERS, MAX_ANCHORS, LR, SEED,
# MAX_NEW, VARIANTS (space-separated triples), OUT (default DEMO_DFLASH/compare-seedSEED).
set -euo pipefail

DEMO=${DEMO_DFLASH:-demo-dflash}
PY=${PY:-python}
STEPS=${STEPS:-300}
B=${B:-8}
DRAFT_LAYERS=${DRAFT_LAYERS:-1}
MAX_ANCHORS=${MAX_ANCHORS:-64}
LR=${LR:-3e-3}
SEED=${SEED:-0}
MAX_NEW=${MAX_NEW:-64}
OUT=${OUT:-$DEMO/compare-seed$SEED}
VARIANTS=${VARIANTS:-"decay,ce,adamw dpace,ce,adamw decay,kl,adamw decay,ce,muon dpace,ce,muon"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
TRAIN="$PY -m dflash_prep.train --device cpu --no-progress"

if [ ! -d "$DEMO/target" ] || [ ! -f "$DEMO/corpus/heldout.jsonl" ]; then
    echo "error: $DEMO is not a finished demo folder; run train/recipes/demo_dflash.sh first (DEMO_DFLASH=$DEMO)" >&2
    exit 1
fi
if [ -d "$DEMO/manifests" ]; then  # the demo's drafter data: pack --objective dflash, else the LM's varlen manifests
    DATA="$DEMO/data" PLAN="$DEMO/plan/plan.json" MANIFESTS="$DEMO/manifests"
    [ -d "$DATA" ] || DATA="$DEMO/lm-data"
else
    DATA="$DEMO/lm-data" PLAN="$DEMO/lm-plan/plan.json" MANIFESTS="$DEMO/lm-manifests"
fi
EPOCHS=$(find "$MANIFESTS" -maxdepth 1 -name 'epoch-*' -type d | wc -l)
mkdir -p "$OUT"

for v in $VARIANTS; do
    IFS=, read -r SW LOSS OPT <<< "$v"
    RUN="$OUT/$SW-$LOSS-$OPT"
    echo "== $SW / $LOSS / $OPT: $STEPS steps -> $RUN"
    $TRAIN --objective dflash --target "$DEMO/target" --draft-layers "$DRAFT_LAYERS" --block-size "$B" \
        --data "$DATA" --plan "$PLAN" --manifests "$MANIFESTS" --out "$RUN/run" --from-scratch --seed "$SEED" \
        --epochs "$EPOCHS" --max-steps "$STEPS" --lr "$LR" --warmup-steps 5 --max-anchors "$MAX_ANCHORS" \
        --slot-weights "$SW" --loss "$LOSS" --optimizer "$OPT"
    $PY -m dflash_prep.train.export "$RUN/run" --out "$RUN/drafter" --overwrite
    $PY -m dflash_prep.train.speculate --target "$DEMO/target" --drafter "$RUN/drafter" \
        --prompts "$DEMO/corpus/heldout.jsonl" --out "$RUN/eval.json" --max-new-tokens "$MAX_NEW"
done

$PY - "$OUT" $VARIANTS <<'PYEOF'
import json, statistics, sys
out, variants = sys.argv[1], sys.argv[2:]
print("\n| slot weights | loss | optimizer | held-out tau | lossless | train tau (last 5) | train loss (first -> last 5) | s/step (median) |")
print("|---|---|---|---|---|---|---|---|")
for v in variants:
    sw, loss, opt = v.split(",")
    run = f"{out}/{sw}-{loss}-{opt}"
    ev, s = json.load(open(f"{run}/eval.json")), json.load(open(f"{run}/run/summary.json"))
    recs = [json.loads(x) for x in open(f"{run}/run/log.jsonl").read().splitlines()[1:]]
    dt = statistics.median(r["step_time_s"] for r in recs)
    print(f"| {sw} | {loss} | {opt} | {ev['tau']:.3f} | {ev['lossless']} | {s['tau_last']:.3f} | "
          f"{s['loss_first']:.3f} -> {s['loss_last']:.3f} | {dt:.3f} |")
PYEOF
