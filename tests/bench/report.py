#!/usr/bin/python3
"""Merges the figures of gradwatch_bench and pushgateway.py into one JSON file and prints the table
of tests/bench/run.sh, with the targets of issue 10 beside the figures.

Usage: report.py GRADWATCH_JSON PUSHGATEWAY_JSON OUT_JSON
"""
import json
import os
import platform
import sys
import time


def fmt(x, digits=0):
    return f"{x:,.{digits}f}"


def machine():
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return f"{os.cpu_count()} cores ({model}), {mem_kb / 2**20:.0f} GiB, {platform.system()} {platform.release()}"


def pgw_share(p):
    text = f"{p['steps_in_prometheus']} of {fmt(p['pushes'])} ({100 * p['share_in_prometheus']:.1f}%)"
    if p.get("last_scrape_health", "up") != "up":
        error = p.get("last_scrape_error", "")
        text += f"; scrapes fail ({error.rsplit(':', 1)[-1].strip()[:40]})"
    return text


def journal_share(r):
    """The journal writer's share of the daemon's steady-state CPU (threads summed by name)."""
    threads = r.get("steady_thread_cpu_s", {})
    total = sum(threads.values())
    return f"{100 * threads.get('gw-journal', 0) / total:.0f}%" if total > 0 else "-"


def table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"
    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def main():
    gw_path, pgw_path, out_path = sys.argv[1:4]
    with open(gw_path) as f:
        gw = json.load(f)
    with open(pgw_path) as f:
        pgw = {row["shape"]: row for row in json.load(f)["pushgateway"]}
    merged = dict(gw)
    merged["pushgateway"] = list(pgw.values())
    merged["machine"] = machine()
    merged["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()[0]
    merged["load_average_1m_at_end"] = load

    print(f"gradwatch benchmark ({gw['mode']}), {merged['date']}, {merged['machine']}, "
          f"load average {load:.1f} at the end")
    print("Samples = values sent by the trainers (2 x params + 1 per rank per step); CPU = the server process's "
          "user + system time (/proc/PID/stat).\n")

    rows = []
    for r in gw["ingest"]:
        p = pgw.get(r["shape"])
        rows.append([f"{r['runs']} x {r['ranks']} x {fmt(r['params'])}", fmt(r["steps"]), fmt(r["series"]),
                     fmt(r["samples_per_cpu_s"]), fmt(r["cpu_ns_per_sample"]), fmt(r["steps_per_s"], 1),
                     fmt(r["ack_p99_ms"], 1), fmt(r["rss_after_bytes"] / 2**20), journal_share(r),
                     fmt(p["samples_per_cpu_s"]) if p else "-",
                     pgw_share(p) if p else "-"])
    print(table(["runs x ranks x params", "steps", "series", "gradwatchd samples/CPU-s", "ns/sample",
                 "steps/s", "ack p99 ms (16 steps in flight)", "RSS MB", "journal thread's share of CPU",
                 "Pushgateway samples/CPU-s",
                 "Pushgateway: rank-steps reaching Prometheus"], rows))

    solo = next(r for r in gw["ingest"] if r["runs"] == 1 and r["ranks"] == 1 and r["params"] == 1000)
    big = max((r for r in gw["ingest"] if r["runs"] == 1 and r["ranks"] == 1), key=lambda r: r["params"])
    pc, ec = gw["parse_ceiling"], gw["empty_stream_ceiling"]
    al, m, sr = gw["alert_latency"], gw["metrics"], gw["single_run"]
    lr = gw["large_restart"]
    print()
    print(table(["figure", "value"], [
        ["ceiling: protobuf parse of the same 1 x 1 x 1,000 frames", f"{fmt(pc['samples_per_cpu_s'])} samples/CPU-s"],
        ["ceiling: empty-handler gRPC stream, 1 x 1 x 1,000",
         f"{fmt(ec['samples_per_cpu_s'])} samples/CPU-s, {fmt(ec['steps_per_s'])} steps/s"],
        [f"alert latency to the trainer's stream ({al['alerts']} alerts)",
         f"p50 {al['stream_p50_ms']:.2f} ms, p99 {al['stream_p99_ms']:.2f} ms"],
        [f"alert latency to a webhook ({al['alerts']} alerts)",
         f"p50 {al['webhook_p50_ms']:.2f} ms, p99 {al['webhook_p99_ms']:.2f} ms"],
        *[[f"/metrics at {fmt(m[size]['series'])} series",
           f"{m[size]['p50_ms']:.0f} ms (median of {m[size]['scrapes']}), {m[size]['bytes'] / 2**20:.1f} MB; "
           f"gzip {m[size]['gzip_p50_ms']:.0f} ms, {m[size]['gzip_bytes'] / 2**20:.1f} MB; "
           f"the first scrape after start (allocating the buffers later scrapes reuse) {m[size]['first_ms']:.0f} ms"]
          for size in ("small", "large")],
        [f"ingest ack latency, one step in flight, without scrapes ({fmt(m['ingest_without_scrapes']['series'])} series)",
         f"p50 {m['ingest_without_scrapes']['ack_p50_ms']:.1f} ms, p99 {m['ingest_without_scrapes']['ack_p99_ms']:.1f} ms"],
        *[[f"ingest ack latency, one step in flight, while /metrics ({fmt(m[k]['series'])} series) is scraped",
           f"p50 {m[k]['ack_p50_ms']:.1f} ms, p99 {m[k]['ack_p99_ms']:.1f} ms ({m[k]['scrapes']} scrapes)"]
          for k in ("ingest_while_scraping", "ingest_while_scraping_large")],
        [f"RSS per series (1 x 1 x 1,000 after {fmt(sr['steps'])} steps; fixed costs weigh at 2,001 series)",
         f"{sr['rss_per_series_bytes'] / 1024:.0f} KB"],
        [f"RSS holding {fmt(big['series'])} series (1 x 1 x {fmt(big['params'])} after {fmt(big['steps'])} steps): "
         "the daemon's, and what the run added, per series",
         f"{big['rss_after_bytes'] / 2**20:.0f} MB: {big['rss_after_bytes'] / big['series'] / 1024:.1f} KB per series; "
         f"added {big['rss_per_series_bytes'] / 1024:.1f} KB per series"],
        ["journal bytes per sample (journal.db + WAL after SIGTERM)", f"{sr['journal_bytes_per_sample']:.1f}"],
        [f"restart to ready ({fmt(sr['journal_samples'])} journaled samples)", f"{sr['restart_s']:.2f} s"],
        [f"large journal of float32 norms ({fmt(lr['samples'])} samples, {fmt(lr['series'])} series): bytes per sample",
         f"{lr['journal_bytes_per_sample']:.2f}"],
        [f"large journal: read back by the journal alone ({fmt(lr['samples'])} samples)",
         f"{lr['journal_read_s']:.2f} s ({lr['samples'] / max(lr['journal_read_s'], 1e-9) / 1e6:.0f} M samples/s)"],
        [f"large journal: restart to ready replaying all of it ({fmt(lr['samples'])} samples)",
         f"{lr['restart_s']:.2f} s; at 1 B samples, linearly: {lr['restart_s'] * 1e9 / lr['samples']:.0f} s"],
        [f"large journal: restart to ready from the run's snapshot ({lr['snapshot_bytes'] / 2**20:.1f} MB)",
         f"{lr['snapshot_restart_s']:.2f} s (reads no step before the snapshot: independent of the journal's length)"],
        ["large journal: clean stop, writing the snapshot",
         f"{lr['snapshot_stop_s']:.2f} s; the run's lock held {lr['snapshot_lock_ms']:.0f} ms to copy its state"],
    ]))

    # The CPU targets read the pairs of runs back to back (gradwatch_bench's RatioPart): the machine's
    # speed shifts between the table's runs, minutes apart.
    ratio = big["cpu_ns_per_sample"] / solo["cpu_ns_per_sample"]
    rp = gw["ratio"]
    pairs = len(rp["pairs"])
    alert_p99 = max(al["stream_p99_ms"], al["webhook_p99_ms"])
    targets = [
        ["≥ 2,000,000 samples per daemon CPU-second at 1,000 params",
         f"{fmt(rp['median_small_samples_per_cpu_s'])} (median of {pairs} runs; "
         f"{fmt(solo['samples_per_cpu_s'])} in the table's run)",
         rp["median_small_samples_per_cpu_s"] >= 2e6],
        [f"CPU per sample at {fmt(rp['big_params'])} params ≤ 1.2 x that at 1,000",
         f"{rp['median_ratio']:.2f} x (median of {pairs} pairs of runs back to back, "
         f"{rp['least_ratio']:.2f}–{rp['most_ratio']:.2f}; {ratio:.2f} x from the table's runs)",
         rp["median_ratio"] <= 1.2],
        [f"≤ 20 KB RSS per series at the defaults ({fmt(big['series'])} series after {fmt(big['steps'])} steps, "
         "the daemon's RSS / series)", f"{big['rss_after_bytes'] / big['series'] / 1024:.1f} KB",
         big["rss_after_bytes"] / big["series"] <= 20 * 1024],
        ["alert p99 < 5 ms (stream and webhook)", f"{alert_p99:.2f} ms", alert_p99 < 5],
        [f"/metrics at {fmt(m['large']['series'])} series < 250 ms (median scrape, plain and gzip)",
         f"{max(m['large']['p50_ms'], m['large']['gzip_p50_ms']):.0f} ms",
         max(m["large"]["p50_ms"], m["large"]["gzip_p50_ms"]) < 250],
        ["journal ≤ 3 bytes per sample (float32 norms, large journal)", f"{lr['journal_bytes_per_sample']:.2f}",
         lr["journal_bytes_per_sample"] <= 3],
        ["restart within 10 s at 1 B journaled samples (from a snapshot, which reads no step before it)",
         f"{lr['snapshot_restart_s']:.2f} s", lr["snapshot_restart_s"] <= 10],
    ]
    merged["targets"] = [{"target": t, "value": v, "pass": ok} for t, v, ok in targets]
    print()
    print(table(["target (issue 10)", "measured", "result"], [[t, v, "pass" if ok else "MISS"] for t, v, ok in targets]))
    with open(out_path, "w") as f:
        json.dump(merged, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
