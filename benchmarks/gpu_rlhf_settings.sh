#!/usr/bin/env bash
# The RLHF recipe on a GPU: make-prefs -> train-rm (one, and an ensemble of 3) -> PPO with a
# critic (train --local) once per anti-hacking setting and seed, WAVE runs at a time; each run's
# metrics and logs packed into $OUT/results.tgz after each wave. Re-running skips what is done.
# Env: MODEL (a HF model dir), DEVICE, PROMPTS, ITERS, WAVE, SETTINGS, SEEDS, DEADLINE_S, R, RLHF.
#
# Measured on a lent H200 (2026-11-27; SmolLM2-135M imported on the machine from its GGUF, which
# travels in two parts of < 64 MiB; the project's missing packages as wheels): make-prefs 51 s
# (3,072 pairs of 384 prompts), train-rm 49 s (held-out 0.819 on 464 pairs), the ensemble of 3
# 2 m 40 s (0.836); a wave of 8 PPO runs of 20 iterations did not finish in the 5 minutes left of
# a 10-minute call: give the PPO waves a call of their own (WAVE=8 DEADLINE_S=560).
set -u
T0=$(date +%s)
DEVICE=${DEVICE:-cuda}; PROMPTS=${PROMPTS:-384}; ITERS=${ITERS:-20}; WAVE=${WAVE:-8}
DEADLINE_S=${DEADLINE_S:-560}; R=${R:-runs/gpu-rlhf}; MODEL=${MODEL:-runs/smollm2-135m}
RLHF=${RLHF:-python3 -m services.cli}
SETTINGS=${SETTINGS:-"baseline ensemble penalty critic-from-rm clip target-kl rollback iters30"}
SEEDS=${SEEDS:-"0 1"}
OUT=${OUT:-$R/out}
mkdir -p "$R" "$OUT"
C="-c configs/smollm2-rlhf.yaml --set model.path=$MODEL --set model.device=$DEVICE"
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
pack() { tar czf "$OUT/results.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
  --exclude='*/tensorboard' --exclude='*/redis' "$R"/*.log "$R"/*.json* "$R"/reward-model "$R"/reward-ensemble "$R"/settings 2>/dev/null; ls -la "$OUT"; }
trap pack EXIT

if [ ! -s "$R/pairs.jsonl" ]; then
  $RLHF make-prefs $C --out "$R/pairs.jsonl" --limit "$PROMPTS" --n 8 --more 8 --hard-negatives 4 \
    --max-pairs-per-prompt 8 > "$R/prefs.log" 2>&1 || { tail -30 "$R/prefs.log"; exit 1; }
  tail -3 "$R/prefs.log"; echo "prefs done at $(( $(date +%s) - T0 )) s"
fi
RMS="--set reward_model.train=$R/pairs.jsonl"
[ -s "$R/reward-model/reward_stats.json" ] || ($RLHF train-rm $C $RMS --set reward_model.out=$R/reward-model > "$R/rm.log" 2>&1; tail -12 "$R/rm.log") &
[ -s "$R/reward-ensemble/ensemble.json" ] || ($RLHF train-rm $C $RMS --set reward_model.out=$R/reward-ensemble \
  --set reward_model.ensemble=3 > "$R/rm-ensemble.log" 2>&1; tail -12 "$R/rm-ensemble.log") &
wait
echo "reward models done at $(( $(date +%s) - T0 )) s"

sets_for() {
  case $1 in
    baseline) echo "" ;;
    ensemble) echo "--set reward.model_path=$R/reward-ensemble" ;;
    penalty) echo "--set reward.model_path=$R/reward-ensemble --set reward.ensemble_penalty=1.0" ;;
    critic-from-rm) echo "--set critic.init_from_reward_model=true" ;;
    clip) echo "--set reward_clip=1.5" ;;
    target-kl) echo "--set target_kl=0.3" ;;
    rollback) echo "--set run.gold_drop=0.05" ;;
    iters30) echo "--set run.iterations=30" ;;
    kl005) echo "--set init_kl_coef=0.05" ;;
    lr3e5) echo "--set actor_lr=3.0e-5" ;;
    *) echo "unknown setting $1" >&2; exit 2 ;;
  esac
}
one() {  # one PPO run; its weights dropped after (the disk holds a wave's, not every run's)
  local name=$1 seed=$2 d="$R/settings/$1-s$2"
  [ -s "$d/summary.json" ] && return
  rm -rf "$d"; mkdir -p "$d"
  $RLHF train --local $C --run-dir "$d" --set reward.model_path=$R/reward-model --set run.seed="$seed" \
    --set run.iterations="$ITERS" --set run.checkpoint_interval=0 --set run.keep_checkpoints=1 \
    $(sets_for "$name") > "$d/train.log" 2>&1 || echo "FAILED $name-s$seed: $(tail -3 "$d/train.log")"
  rm -rf "$d/checkpoints" "$d/final_critic" "$d/final" "$d/best"
  echo "$name-s$seed done at $(( $(date +%s) - T0 )) s: $(python3 -c "
import json,sys; r=[json.loads(l) for l in open('$d/metrics.jsonl')]; e=[x['eval/reward_mean'] for x in r if 'eval/reward_mean' in x]
print('gold', [round(v,3) for v in e])" 2>&1 | tail -1)"
}
jobs_=()
for s in $SETTINGS; do for seed in $SEEDS; do jobs_+=("$s $seed"); done; done
i=0
while [ $i -lt ${#jobs_[@]} ]; do
  if [ "$(left)" -lt 200 ]; then echo "stopping: $(left) s left, ${#jobs_[@]} runs, $i started"; break; fi
  for j in $(seq 1 "$WAVE"); do
    [ $i -lt ${#jobs_[@]} ] || break
    one ${jobs_[$i]} & i=$((i + 1))
  done
  wait
  pack > /dev/null
done
echo "all done at $(( $(date +%s) - T0 )) s"
