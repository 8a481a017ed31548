"""tokenmill bench: serve (against a real server), offline continuous vs static, the report math."""

from __future__ import annotations

import json

import pytest
from server_harness import start_server

from tokenmill.bench.offline import make_workload
from tokenmill.bench.serve import summarize
from tokenmill.bench.sse_client import StreamRecord
from tokenmill.cli import main


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"], tmp_path_factory.mktemp("bench"))
    yield process
    assert process.stop() == 0


def test_bench_serve_reports_every_field(server, tmp_path, capsys):
    out, png = tmp_path / "report.json", tmp_path / "report.png"
    assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "12", "--input-len", "16",
                 "--output-len", "8", "--request-rate", "40", "--max-concurrency", "4", "--slo-ttft-ms", "60000",
                 "--slo-itl-ms", "60000", "--cost-per-hour", "1.5", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == report
    assert (report["completed"], report["failed"]) == (12, 0)
    assert report["prompt_tokens"] == 12 * 16 and report["output_tokens"] == 12 * 8
    assert report["output_throughput"] == pytest.approx(96 / report["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = report[key]
        assert 0 < stats["median"] <= stats["p90"] <= stats["p99"], key
    assert report["ttft_ms"]["p99"] <= report["e2e_ms"]["p99"]
    assert report["ttft_ms"]["mean"] <= report["e2e_ms"]["mean"]
    assert report["good_fraction"] == 1.0
    assert report["goodput_requests_per_s"] == pytest.approx(report["request_throughput"])
    assert report["cost_per_1m_output_tokens"] == pytest.approx(1.5 * report["duration_s"] / 3600 / 96 * 1e6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_jsonl_dataset(server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Question {i} about mills?", "max_tokens": 3 + i})
                              for i in range(3)))
    assert main(["bench", "serve", "--base-url", server.base_url, "--dataset", str(data), "--num-prompts", "6",
                 "--json", str(tmp_path / "r.json")]) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["completed"] == 6 and report["output_tokens"] == 2 * (3 + 4 + 5)


def test_slo_and_goodput_math():
    def record(ttft, e2e, tokens):
        r = StreamRecord(start=0.0, first_token=ttft, end=e2e, output_tokens=tokens, prompt_tokens=10)
        r.token_times = [ttft + i * (e2e - ttft) / max(1, tokens - 1) for i in range(tokens)]
        return r

    records = [record(0.1, 1.0, 10), record(0.5, 1.4, 10), record(0.1, 5.0, 10),
               StreamRecord(start=0.0, end=1.0, error="HTTP 503")]
    report = summarize(records, duration=10.0, slo_ttft_ms=200, slo_itl_ms=200, cost_per_hour=None)
    assert (report["completed"], report["failed"]) == (3, 1)
    assert report["goodput_requests_per_s"] == pytest.approx(0.1)  # only the first meets both SLOs
    assert report["good_fraction"] == 0.25
    assert report["tpot_ms"]["median"] == pytest.approx(100)
    assert "cost_per_1m_output_tokens" not in report


def test_bench_offline_both_modes(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    assert main(["bench", "offline", "--model", str(tiny_llama_dir), "--dtype", "float32", "--num-prompts", "20",
                 "--batch-size", "6", "--max-prompt-len", "40", "--short-output", "2,8", "--long-output", "40,60",
                 "--long-fraction", "0.2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    continuous, static = report["results"]
    assert (continuous["mode"], static["mode"]) == ("continuous", "static")
    items = make_workload(20, 49152, 16, 40, (2, 8), (40, 60), 0.2, 0)
    expected_output = sum(item.output_len for item in items)
    assert continuous["output_tokens"] == static["output_tokens"] == expected_output
    assert continuous["prompt_tokens"] == static["prompt_tokens"] == sum(len(i.prompt_token_ids) for i in items)
    assert report["continuous_over_static"] == pytest.approx(
        continuous["output_tokens_per_s"] / static["output_tokens_per_s"])
    assert "continuous / static" in capsys.readouterr().out
