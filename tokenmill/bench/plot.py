"""--plot for `tokenmill bench serve`: latency CDFs and output throughput over time, as one PNG."""

from __future__ import annotations

from tokenmill.bench.sse_client import StreamRecord


def plot_records(records: list[StreamRecord], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    done = [r for r in records if r.error is None]
    fig, (cdf_ax, rate_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    series = {
        "TTFT": [r.ttft for r in done],
        "TPOT": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1],
        "ITL": [gap for r in done for gap in r.itls],
        "E2E": [r.e2e for r in done],
    }
    for name, values in series.items():
        if values:
            ordered = sorted(v * 1000 for v in values)
            cdf_ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=name)
    cdf_ax.set_xscale("log")
    cdf_ax.set_xlabel("milliseconds")
    cdf_ax.set_ylabel("fraction of requests (tokens for ITL)")
    cdf_ax.set_title("latency CDFs")
    cdf_ax.legend()

    start = min((r.start for r in records), default=0.0)
    times = sorted(t - start for r in done for t in r.token_times)
    if times:
        seconds = int(times[-1]) + 1
        counts = [0] * seconds
        for t in times:
            counts[int(t)] += 1
        rate_ax.step(range(seconds), counts, where="post")
    rate_ax.set_xlabel("seconds since the first request")
    rate_ax.set_ylabel("streamed chunks per second (~ output tokens/s)")
    rate_ax.set_title("throughput over time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
