#!/usr/bin/env bash
# The GPU check, one command (issue 46, item 5): on one GPU, nothing downloaded there, within
# DEADLINE_S (default 540 s, under 9 minutes on one H100):
#   1. `rlhf up` and `rlhf train --local` on the SmolLM2 recipe (benchmarks/bench_iteration.py,
#      configs/smollm2-cpu.yaml on cuda, micro-batches of 128), seconds per iteration split into
#      generate / train / push;
#   2. TRL's GRPOTrainer on the same recipe (benchmarks/bench_trl.py; skipped when trl is not
#      installed: it is a yardstick, not a dependency);
#   3. the learner's and the critic's steps at configs/gpu.yaml's sizes on a Qwen2.5-0.5B shape
#      (benchmarks/bench_steps.py, random weights);
#   4. when time is left, `rlhf up` again with generation ahead of the learner and weight updates
#      in flight (max_staleness=1, generation.weight_update=in_flight; docs/async.md);
# then one comparison table (s/iteration, samples/s, vs TRL). Every part writes JSON under $OUT
# (default runs/gpu-check) and the table goes to $OUT/summary.txt: copy its figures into
# docs/speed.md with the machine and the date.
#
#   MODEL=runs/smollm2-135m bash benchmarks/gpu_check.sh
#
# Env: MODEL (a Hugging Face directory of SmolLM2-135M-Instruct: `make smollm2` writes it; on a
# machine with no network, carry the GGUF and run `rlhf init-model --from-gguf` there), DEVICE
# (cuda), ITERS (rollout iterations per system, 6), STEPS_SHAPE (qwen2.5-0.5b) and STEPS_SET (config
# overrides of part 3), DEADLINE_S, OUT, PY (python3). A CPU smoke test of the script itself:
#   DEVICE=cpu ITERS=2 STEPS_SHAPE=tiny STEPS_SET="--set rollout_batch_size=8" bash benchmarks/gpu_check.sh
# A part that would start past the deadline is skipped and says so.
set -u
T0=$(date +%s)
MODEL=${MODEL:-runs/smollm2-135m}; DEVICE=${DEVICE:-cuda}; ITERS=${ITERS:-6}
DEADLINE_S=${DEADLINE_S:-540}; OUT=${OUT:-runs/gpu-check}; PY=${PY:-python3}
STEPS_SHAPE=${STEPS_SHAPE:-qwen2.5-0.5b}; STEPS_SET=${STEPS_SET:-}
mkdir -p "$OUT"
left() { echo $((DEADLINE_S - ($(date +%s) - T0))); }
part() {  # part NAME SECONDS_NEEDED CMD...: run CMD unless fewer than SECONDS_NEEDED are left
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt "$need" ]; then echo "[$name] skipped: $(left) s left, it needs ~$need s"; return; fi
  echo "[$name] $(date +%T) $*"
  timeout "$(left)" "$@" > "$OUT/$name.log" 2>&1 || echo "[$name] FAILED (rc $?): $(tail -3 "$OUT/$name.log")"
  tail -4 "$OUT/$name.log"
}
[ -f "$MODEL/config.json" ] || { echo "no model at $MODEL (MODEL=...; make smollm2)"; exit 2; }
"$PY" -c "import torch; assert torch.cuda.is_available() or '$DEVICE' == 'cpu', 'no CUDA device'; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" \
  || exit 2
RECIPE="--set model.path=$MODEL --set model.device=$DEVICE --set micro_batch_size=128 --set log_prob_micro_batch_size=128"
# shellcheck disable=SC2086
part ours 240 "$PY" benchmarks/bench_iteration.py -c configs/smollm2-cpu.yaml --iterations "$ITERS" $RECIPE \
  --out-dir "$OUT/iteration"
if "$PY" -c "import trl" 2>/dev/null; then
  part trl 120 "$PY" benchmarks/bench_trl.py --model "$MODEL" --iterations "$ITERS" --device "$DEVICE" --out "$OUT/trl.json"
else
  echo "[trl] skipped: trl is not installed (pip install trl==1.12.0)"
fi
# shellcheck disable=SC2086
part steps 90 "$PY" benchmarks/bench_steps.py -c configs/gpu.yaml --shape "$STEPS_SHAPE" --device "$DEVICE" $STEPS_SET \
  --out "$OUT/steps.json"
# shellcheck disable=SC2086
part in-flight 120 "$PY" benchmarks/bench_iteration.py -c configs/smollm2-cpu.yaml --iterations "$ITERS" $RECIPE \
  --modes up --set max_staleness=1 --set generation.weight_update=in_flight --out-dir "$OUT/iteration-in-flight"
"$PY" - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = []
it = out / "iteration" / "summary.json"
if it.exists():
    for r in json.loads(it.read_text()):
        name = {"up": "rlhf up", "local": "train --local"}.get(r["mode"], r["mode"])
        rows.append((name, r["s_per_iteration"], r["samples_per_s"]))
flight = out / "iteration-in-flight" / "summary.json"
if flight.exists():
    for r in json.loads(flight.read_text()):
        rows.append(("up, in flight", r["s_per_iteration"], r["samples_per_s"]))
trl = out / "trl.json"
if trl.exists():
    t = json.loads(trl.read_text())
    rows.append(("trl", t.get("s_per_iteration"), t.get("samples_per_s")))
ref = next((s for name, s, _ in rows if name == "trl" and s), None)
print(f"{'system':<14} {'s/iteration':>11} {'samples/s':>10} {'vs TRL':>7}")
for name, s, sps in rows:
    vs = f"{ref / s:.2f}x" if ref and s else "-"
    print(f"{name:<14} {s:>11.2f} {sps:>10.1f} {vs:>7}")
steps = out / "steps.json"
if steps.exists():
    r = json.loads(steps.read_text())[-1]  # the run after the warm-up
    print(
        f"configs/gpu.yaml steps ({r['shape']}, {r['rollout_batch_size']} x {r['prompt_length']}+{r['response_length']}"
        f" tokens): critic values {r['values_s']:.1f} s, learner step {r['step_s']:.1f} s, "
        f"{r['tokens_per_s']:.0f} tokens/s, peak GPU {r['peak_gpu_gib']} GiB"
    )
PY
echo "done in $(( $(date +%s) - T0 )) s; logs and JSON in $OUT"
