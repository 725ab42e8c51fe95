"""Writes the Grafana dashboard of an RLHF run, dashboards/rlhf.json, from the panel list below.

    python deploy/grafana/dashboard.py          (a test checks the committed JSON is what this writes)

Every query is PromQL over the metrics the services export (docs/metrics.md); a test checks each
one parses (promtool) and that every metric it names is exported by a live run."""
from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "rlhf.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
JOBS = 'job=~"learner|generation|reward|critic|teacher|rollout|gateway"'  # this system's processes, not Prometheus's own

# (row title, [(panel title, unit, [(expr, legend)])])
ROWS = [
    ("Learning", [
        ("Reward: train and held-out", "none", [
            ("rlhf_learner_reward", "train"), ("rlhf_learner_eval_reward", "held-out")]),
        ("Reward hacking watch (1 = held-out falls while train rises)", "none", [
            ("rlhf_learner_reward_hacking", "suspected")]),
        ("KL to the reference", "none", [("rlhf_learner_kl", "KL")]),
        ("Clip fraction", "percentunit", [("rlhf_learner_clip_fraction", "clipped")]),
        ("Policy entropy", "none", [("rlhf_learner_entropy", "entropy")]),
        ("Sampler/learner drift (rollout_correction)", "none", [
            ("rlhf_learner_rollout_drift_kl", "KL"), ("rlhf_learner_rollout_drift_ess", "ESS per sequence"),
            ("rlhf_learner_rollout_masked_fraction", "masked fraction")]),
        ("On-policy distillation: the student against the teacher", "none", [
            ("rlhf_learner_distill_reverse_kl", "reverse KL per token"),
            ("rlhf_learner_distill_top1_agreement", "teacher top-1 agreement")]),
        ("Push parity: the servers' log-probs against the learner's", "none", [
            ("max by (server) (rlhf_push_parity_mean_abs)", "{{server}} mean |diff|"),
            ("sum(increase(rlhf_push_parity_failures_total[1h]))", "failed checks (1h)")]),
        ("Iteration", "none", [("rlhf_learner_iteration", "iteration"),
                               ("rlhf_learner_policy_version", "policy version")]),
    ]),
    ("Speed", [
        ("Iteration time and its parts", "s", [
            ("rlhf_learner_iteration_seconds", "iteration"),
            ("rlhf_learner_phase_seconds", "{{phase}}")]),
        ("Generation tokens/s", "none", [
            ("sum(rate(rlhf_generated_tokens_total[1m]))", "all servers"),
            ("sum by (instance) (rate(rlhf_generated_tokens_total[1m]))", "{{instance}}")]),
        ("Weight push", "s", [("rlhf_learner_push_seconds", "push"),
            ("max(rate(rlhf_weight_swap_wait_seconds_sum[5m]) / rate(rlhf_weight_swap_wait_seconds_count[5m]))",
             "waiting for a batch (slowest server)")]),
    ]),
    ("Replay buffer", [
        ("Prompts waiting for workers, trajectories waiting for the learner", "none", [
            ("rlhf_replay_prompts_waiting", "prompts waiting"), ("rlhf_replay_lag", "trajectory groups waiting")]),
        ("Staleness (policy versions behind)", "none", [("rlhf_replay_staleness", "mean")]),
        ("Dropped, duplicate, dead-lettered (per minute)", "none", [
            ("rate(rlhf_replay_dropped_stale_total[5m]) * 60", "dropped stale"),
            ("sum(rate(rlhf_rollout_duplicates_total[5m])) * 60", "duplicates"),
            ("sum(rate(rlhf_rollout_dead_letters_total[5m])) * 60", "dead letters"),
            ("rate(rlhf_replay_dropped_equal_total[5m]) * 60", "all-equal rewards (dynamic sampling)")]),
        ("Rollout workers: prompts claimed and reclaimed (per minute)", "none", [
            ("count(up{job=\"rollout\"} == 1)", "workers up"),
            ("sum(rate(rlhf_rollout_prompts_claimed_total[5m])) * 60", "claimed"),
            ("sum(rate(rlhf_rollout_prompts_reclaimed_total[5m])) * 60", "reclaimed")]),
    ]),
    ("Services", [
        ("RPC rate by service and method", "reqps", [
            ("sum by (service, method) (rate(rlhf_rpc_requests_total[1m]))", "{{service}} {{method}}")]),
        ("RPC latency p95", "s", [
            ("histogram_quantile(0.95, sum by (le, service, method) (rate(rlhf_rpc_latency_seconds_bucket[5m])))",
             "{{service}} {{method}}")]),
        ("RPC errors", "reqps", [
            ("sum by (service, method, code) (rate(rlhf_rpc_requests_total{code!=\"OK\"}[5m]))",
             "{{service}} {{method}} {{code}}")]),
        ("Reward API calls by outcome", "reqps", [
            ("sum by (outcome) (rate(rlhf_reward_api_requests_total[5m]))", "{{outcome}}"),
            ("sum by (path, code) (rate(rlhf_http_requests_total{service=\"reward\"}[5m]))",
             "reward server HTTP {{path}} {{code}}")]),
        ("CPU per service (cores)", "none", [
            (f"sum by (job) (rate(process_cpu_seconds_total{{{JOBS}}}[1m]))", "{{job}}")]),
        ("Memory per service", "bytes", [
            (f"sum by (job) (process_resident_memory_bytes{{{JOBS}}})", "{{job}}")]),
    ]),
    ("Gateway (rlhf serve gateway)", [
        ("Requests by route and status", "reqps", [
            ("sum by (path, code) (rate(rlhf_http_requests_total{service=\"gateway\"}[5m]))", "{{path}} {{code}}")]),
        ("Turn latency", "s", [
            ("histogram_quantile(0.5, sum by (le) (rate(rlhf_gateway_turn_seconds_bucket[5m])))", "p50"),
            ("histogram_quantile(0.99, sum by (le) (rate(rlhf_gateway_turn_seconds_bucket[5m])))", "p99")]),
        ("Sessions: held, bytes, evicted (per minute)", "none", [
            ("rlhf_gateway_sessions", "sessions"),
            ("rlhf_gateway_session_bytes / 1e6", "MB held"),
            ("sum by (reason) (rate(rlhf_gateway_sessions_evicted_total[5m])) * 60", "evicted ({{reason}})")]),
    ]),
]


def _panel(pid: int, title: str, unit: str, queries, x: int, y: int) -> dict:
    return {"id": pid, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(queries)]}


def dashboard() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        for i, (title, unit, queries) in enumerate(row):
            panels.append(_panel(pid, title, unit, queries, 8 * (i % 3), y + 8 * (i // 3)))
            pid += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "uid": "rlhf-run", "title": "RLHF run", "tags": ["rlhf"], "schemaVersion": 39, "version": 1,
        "editable": True, "refresh": "30s", "time": {"from": "now-6h", "to": "now"},
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0}]},
        "annotations": {"list": []}, "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
