// The dashboard: tiles of the present figures, charts of the last minutes, recent requests, facts.
// Every figure comes from the feed (/v1/stats/stream); nothing here computes a metric of its own.
import { element } from "./dom.js";

const HISTORY_POINTS = 600;  // the server's history: 10 minutes at one point per second

const pct = (v) => `${(100 * v).toFixed(1)} %`;
const num = (digits) => (v) => v.toFixed(digits);
const secs = (v) => (v < 1 ? `${(1000 * v).toFixed(0)} ms` : `${v.toFixed(2)} s`);
const dollars = (v) => `$${v < 0.01 ? v.toPrecision(2) : v.toFixed(2)}`;

// [data-stat key, label, value from a snapshot, format]
const TILES = [
  ["running", "Running", (s) => s.engine.num_requests_running, num(0)],
  ["waiting", "Waiting", (s) => s.engine.num_requests_waiting, num(0)],
  ["kv_usage", "KV cache used", (s) => s.engine.kv_cache && s.engine.kv_cache.usage, pct],
  ["kv_waste", "KV slots empty", (s) => s.engine.kv_cache && s.engine.kv_cache.waste, pct],
  ["prefix_hit_rate", "Prefix-cache hits", (s) => s.engine.prefix_cache_hit_rate, pct],
  ["batch_size", "Batch size", (s) => s.window.mean_batch_size, num(1)],
  ["budget_occupancy", "Token budget used", (s) => s.window.token_budget_occupancy, pct],
  ["preemptions", "Preemptions", (s) => s.engine.num_preemptions, num(0)],
  ["busy", "Busy", (s) => s.window.engine_busy_fraction, pct],
  ["mfu", "MFU", (s) => s.window.model_flops_utilization, pct],
  ["mbu", "MBU", (s) => s.window.memory_bandwidth_utilization, pct],
  ["prompt_tps", "Prompt tok/s", (s) => s.window.prefill_tokens_per_second, num(1)],
  ["output_tps", "Output tok/s", (s) => s.window.output_tokens_per_second, num(1)],
  ["ttft_p50", "TTFT p50", (s) => s.window.time_to_first_token_p50_seconds, secs],
  ["ttft_p99", "TTFT p99", (s) => s.window.time_to_first_token_p99_seconds, secs],
  ["itl_p50", "ITL p50", (s) => s.window.inter_token_latency_p50_seconds, secs],
  ["itl_p99", "ITL p99", (s) => s.window.inter_token_latency_p99_seconds, secs],
  ["cost_output", "$ / 1M output tokens", (s) => s.window.cost_per_1m_output_tokens, dollars],
  ["cost_total", "$ / 1M tokens", (s) => s.window.cost_per_1m_total_tokens, dollars],
  ["requests_finished", "Requests done", (s) => s.totals.requests_finished, num(0)],
  ["generation_tokens", "Tokens generated", (s) => s.totals.generation_tokens, num(0)],
];

const FACTS = [
  ["model_name", "Model"], ["model_file", "File"], ["architecture", "Architecture"], ["dtype", "dtype"],
  ["weights", "Weights"], ["max_model_len", "Context length"], ["num_kv_blocks", "KV blocks"],
  ["block_size", "Block size"], ["max_num_seqs", "max_num_seqs"], ["max_num_batched_tokens", "Token budget"],
  ["device", "Device"], ["tensor_parallel_size", "Tensor parallel"], ["cost_per_hour", "Cost per hour ($)"],
  ["version", "tokenmill"],
];

// [chart element id, series: [label, value of a history point, color]]
const CHARTS = [
  ["chart-tokens", [["output", (p) => p.output_tokens_per_second, "#2b7bb9"],
                    ["prompt", (p) => p.prefill_tokens_per_second, "#e08a1e"]]],
  ["chart-requests", [["running", (p) => p.num_requests_running, "#2b7bb9"],
                      ["waiting", (p) => p.num_requests_waiting, "#c0392b"]]],
  ["chart-kv", [["KV used %", (p) => 100 * p.kv_cache_usage, "#27ae60"]]],
  ["chart-latency", [["TTFT p50", (p) => p.time_to_first_token_p50_seconds, "#8e44ad"],
                     ["TTFT p99", (p) => p.time_to_first_token_p99_seconds, "#d35400"],
                     ["ITL p50", (p) => p.inter_token_latency_p50_seconds, "#16a085"],
                     ["ITL p99", (p) => p.inter_token_latency_p99_seconds, "#7f8c8d"]]],
  ["chart-cost", [["output", (p) => p.cost_per_1m_output_tokens, "#2b7bb9"],
                  ["all tokens", (p) => p.cost_per_1m_total_tokens, "#27ae60"]]],
];

// The point the server's history keeps of a snapshot (stats_feed.history_point).
function historyPoint(s) {
  const w = s.window;
  return {
    time: s.time, num_requests_running: s.engine.num_requests_running || 0,
    num_requests_waiting: s.engine.num_requests_waiting || 0,
    kv_cache_usage: s.engine.kv_cache ? s.engine.kv_cache.usage : 0,
    output_tokens_per_second: w.output_tokens_per_second, prefill_tokens_per_second: w.prefill_tokens_per_second,
    time_to_first_token_p50_seconds: w.time_to_first_token_p50_seconds,
    time_to_first_token_p99_seconds: w.time_to_first_token_p99_seconds,
    inter_token_latency_p50_seconds: w.inter_token_latency_p50_seconds,
    inter_token_latency_p99_seconds: w.inter_token_latency_p99_seconds,
    cost_per_1m_output_tokens: w.cost_per_1m_output_tokens, cost_per_1m_total_tokens: w.cost_per_1m_total_tokens,
  };
}

export class Dashboard {
  constructor() {
    this.tiles = new Map();
    const container = document.getElementById("tiles");
    for (const [key, label] of TILES) {
      const tile = element("div", "tile");
      tile.dataset.stat = key;
      const value = element("span", "value", "—");
      tile.append(element("span", "label", label), value);
      container.append(tile);
      this.tiles.set(key, value);
    }
    this.points = [];
    this.charts = [];
    this.factsShown = false;
    window.addEventListener("resize", () => this.resize());
  }

  update(snapshot) {
    if (snapshot.history) this.points = snapshot.history.slice();
    else this.points.push(historyPoint(snapshot));
    if (this.points.length > HISTORY_POINTS) this.points.splice(0, this.points.length - HISTORY_POINTS);
    for (const [key, , value, format] of TILES) {
      const v = value(snapshot);
      const node = this.tiles.get(key);
      node.textContent = v === null || v === undefined ? "—" : format(v);
      node.dataset.raw = v === null || v === undefined ? "" : String(v);
    }
    this.updateCharts();
    this.updateRecent(snapshot.recent_requests || [], snapshot.facts && snapshot.facts.log_prompts);
    if (!this.factsShown && snapshot.facts) this.showFacts(snapshot.facts, snapshot.peaks || {});
  }

  updateCharts() {
    if (typeof uPlot === "undefined" || document.getElementById("dashboard").hidden) return;
    const times = this.points.map((p) => p.time);
    if (!this.charts.length) {
      for (const [id, series] of CHARTS) {
        const target = document.getElementById(id);
        const options = {
          width: Math.max(240, target.clientWidth), height: 150, legend: { live: false },
          scales: { x: { time: true } }, axes: [{}, { size: 50 }],
          series: [{}, ...series.map(([label, , color]) => ({ label, stroke: color, width: 1.5, spanGaps: true }))],
        };
        this.charts.push([new uPlot(options, [times, ...series.map(() => [])], target), series, target]);
      }
    }
    for (const [chart, series] of this.charts) {
      chart.setData([times, ...series.map(([, value]) => this.points.map((p) => {
        const v = value(p);
        return v === null || v === undefined || Number.isNaN(v) ? null : v;
      }))]);
    }
  }

  resize() {
    for (const [chart, , target] of this.charts) chart.setSize({ width: Math.max(240, target.clientWidth), height: 150 });
  }

  updateRecent(requests, withText) {
    const body = document.querySelector("#recent tbody");
    const fmt = (v, f) => (v === null || v === undefined ? "—" : f(v));
    const rows = requests.map((r) => {
      const row = element("tr");
      row.dataset.status = r.status;
      const cells = [r.request_id.slice(0, 12), r.status, r.prompt_tokens, r.output_tokens, r.num_cached_tokens,
                     fmt(r.ttft, secs), fmt(r.tokens_per_second, num(1)), r.finish_reason || "—"];
      for (const text of cells) row.append(element("td", "", String(text)));
      if (withText && (r.prompt || r.output)) row.title = `${r.prompt || ""}\n→ ${r.output || ""}`;
      return row;
    });
    body.replaceChildren(...rows);
  }

  showFacts(facts, peaks) {
    const list = document.getElementById("facts");
    const items = [];
    for (const [key, label] of FACTS) {
      const value = facts[key];
      items.push(element("dt", "", label), element("dd", "", value === null || value === undefined ? "—" : String(value)));
    }
    items.push(element("dt", "", "Peaks"), element("dd", "",
      `${peaks.tflops ? peaks.tflops.toFixed(2) + " TFLOP/s" : "—"}, ` +
      `${peaks.bandwidth_gbs ? peaks.bandwidth_gbs.toFixed(1) + " GB/s" : "—"}`));
    list.replaceChildren(...items);
    this.factsShown = Boolean(peaks.tflops);  // peaks may be measured after start-up: refresh until then
  }
}
