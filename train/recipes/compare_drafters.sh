#!/usr/bin/env bash
# compare_drafters.sh: DFlash, DFlash2 and EAGLE-3 on the CPU demo's target, the same data, steps and seeds.
#
# Needs a demo folder made by train/recipes/demo_dflash.sh (its target, its tokenized drafter data
# and plan, its held-out prompts). Packs the data once per objective (pack --objective dflash /
# dflash2 / eagle3: each balances ranks on its own step cost; dflash and dflash2 share anchors),
# then for each seed in SEEDS trains each drafter from scratch for STEPS optimizer steps with the
# demo's small settings, exports it, decodes the held-out prompts at temperature 0
# (speculate: lossless checked), and prints one markdown table: held-out tau per objective and
# seed (DFlash2 also without its selector), their means, lossless, the last steps' training
# metrics and the step time. EAGLE-3 drafts TTT_STEPS tokens per round, DFlash and DFlash2 fill a
# block of B: the tau columns compare acceptance, not the work per round.
# Knobs (environment): DEMO_DFLASH, PY, STEPS, SEEDS, B, DRAFT_LAYERS, MAX_ANCHORS, LR, MAX_NEW,
# DRAFT_VOCAB, TTT_STEPS, EAGLE3_TAPS, OUT (default DEMO_DFLASH/compare-drafters).
set -euo pipefail

DEMO=${DEMO_DFLASH:-demo-dflash}
PY=${PY:-python}
STEPS=${STEPS:-300}
SEEDS=${SEEDS:-"0 1 2"}
B=${B:-8}
DRAFT_LAYERS=${DRAFT_LAYERS:-1}
MAX_ANCHORS=${MAX_ANCHORS:-64}
LR=${LR:-3e-3}
MAX_NEW=${MAX_NEW:-64}
DRAFT_VOCAB=${DRAFT_VOCAB:-64}
TTT_STEPS=${TTT_STEPS:-7}
EAGLE3_TAPS=${EAGLE3_TAPS:-"0 1 2"}
OUT=${OUT:-$DEMO/compare-drafters}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CLI="$PY -m dflash_prep.cli"
TRAIN="$PY -m dflash_prep.train --device cpu --no-progress"

if [ ! -d "$DEMO/target" ] || [ ! -f "$DEMO/corpus/heldout.jsonl" ] || [ ! -f "$DEMO/plan/plan.json" ]; then
    echo "error: $DEMO is not a finished demo folder; run train/recipes/demo_dflash.sh first (DEMO_DFLASH=$DEMO)" >&2
    exit 1
fi
DATA="$DEMO/data"
[ -d "$DATA" ] || DATA="$DEMO/lm-data"
PLAN="$DEMO/plan/plan.json"
EPOCHS=${EPOCHS:-5}
mkdir -p "$OUT"
for OBJ in dflash dflash2; do
    $CLI pack "$DATA" --plan "$PLAN" --epochs 0-$(( EPOCHS - 1 )) --objective $OBJ --block-size "$B" \
        --max-anchors "$MAX_ANCHORS" --target-config "$DEMO/target" --draft-layers "$DRAFT_LAYERS" \
        --sliding-window 0 --out "$OUT/manifests-$OBJ" --overwrite
done
$CLI pack "$DATA" --plan "$PLAN" --epochs 0-$(( EPOCHS - 1 )) --objective eagle3 --draft-vocab-size "$DRAFT_VOCAB" \
    --ttt-steps "$TTT_STEPS" --target-config "$DEMO/target" --out "$OUT/manifests-eagle3" --overwrite
TAP_FLAGS=$(for t in $EAGLE3_TAPS; do printf -- '--target-layer-ids %s ' "$t"; done)
COMMON="--target $DEMO/target --data $DATA --plan $PLAN --epochs $EPOCHS --max-steps $STEPS --lr $LR --warmup-steps 5 --optimizer adamw --from-scratch"
DFLASH="--draft-layers $DRAFT_LAYERS --block-size $B --max-anchors $MAX_ANCHORS --slot-weights decay --loss ce --sliding-window 0"

for SEED in $SEEDS; do
    for OBJ in dflash dflash2 eagle3; do
        RUN="$OUT/$OBJ-seed$SEED"
        echo "== $OBJ, seed $SEED: $STEPS steps -> $RUN"
        case $OBJ in
            dflash)  $TRAIN --objective dflash $COMMON $DFLASH --manifests "$OUT/manifests-dflash" --seed "$SEED" --out "$RUN/run" ;;
            dflash2) $TRAIN --objective dflash2 $COMMON $DFLASH --manifests "$OUT/manifests-dflash2" --seed "$SEED" --out "$RUN/run" ;;
            eagle3)  $TRAIN --objective eagle3 $COMMON $TAP_FLAGS --manifests "$OUT/manifests-eagle3" --seed "$SEED" --out "$RUN/run" ;;
        esac
        $PY -m dflash_prep.train.export "$RUN/run" --out "$RUN/drafter" --overwrite
        BS=$B; [ "$OBJ" = "eagle3" ] && BS=$(( TTT_STEPS + 1 ))
        $PY -m dflash_prep.train.speculate --target "$DEMO/target" --drafter "$RUN/drafter" --block-size "$BS" \
            --prompts "$DEMO/corpus/heldout.jsonl" --out "$RUN/eval.json" --max-new-tokens "$MAX_NEW"
    done
done

$PY - "$OUT" $SEEDS <<'PYEOF'
import json, statistics, sys
out, seeds = sys.argv[1], sys.argv[2:]
print("\n| objective | held-out tau per seed | mean | without the selector | lossless | train tau (last 5) | s/step (median) | trainable params |")
print("|---|---|---|---|---|---|---|---|")
for obj in ("dflash", "dflash2", "eagle3"):
    evs = [json.load(open(f"{out}/{obj}-seed{s}/eval.json")) for s in seeds]
    sums = [json.load(open(f"{out}/{obj}-seed{s}/run/summary.json")) for s in seeds]
    recs = [json.loads(x) for s in seeds for x in open(f"{out}/{obj}-seed{s}/run/log.jsonl").read().splitlines()[1:]]
    taus = [e["tau"] for e in evs]
    plain = [e["variants"]["no_selector"]["tau"] for e in evs if "no_selector" in e["variants"]]
    params = json.loads(open(f"{out}/{obj}-seed{seeds[0]}/run/log.jsonl").readline())["params"]
    print(f"| {obj} | {' / '.join(f'{t:.3f}' for t in taus)} | {statistics.mean(taus):.3f} | "
          f"{statistics.mean(plain):.3f} |" if plain else f"| {obj} | {' / '.join(f'{t:.3f}' for t in taus)} | "
          f"{statistics.mean(taus):.3f} | - |", end="")
    lossless = all(e["lossless"] and all(v["lossless"] for v in e["variants"].values()) for e in evs)
    print(f" {lossless} | {statistics.mean(s['tau_last'] for s in sums):.3f} | "
          f"{statistics.median(r['step_time_s'] for r in recs):.3f} | {params:,} |")
PYEOF
