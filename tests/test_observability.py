"""Observability: GET /metrics (Prometheus), GET /stats (JSON), GET /dashboard (live charts).

Real server, real model. The browser test drives headless Chromium (`make browser` installs it).
"""
from __future__ import annotations

import json
import os
import re
import statistics
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.devices import cpu_timing
from tests.server_proc import ROOT, running_server

P = "pagedllama:"
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "engine_threads"]
COUNTERS = ["prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
            "prompt_tokens_total", "generation_tokens_total", "request_success_total",
            "thread_changes_total"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "iteration_tokens"]
PROCESS = ["process_cpu_seconds_total", "process_resident_memory_bytes"]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def scrape(base: str) -> dict[str, float]:
    """Every sample of /metrics, keyed `name{label="value",...}` (labels sorted)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include these."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total, found = 0.0, False
    for key, v in samples.items():
        sample_name, _, rest = key.partition("{")
        if sample_name == name and all(w in rest for w in want):
            total, found = total + v, True
    assert found, f"no sample {name} {labels} in /metrics"
    return total


def complete(base: str, model: str, prompt, max_tokens: int, stream: bool = False) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for _ in r.iter_bytes():
            pass


LONG_TEXT = ("The history of paged attention begins with virtual memory: pages, page tables, "
             "and the idea that contiguous addresses need not be contiguous in memory. ") * 8


# ---- /metrics -------------------------------------------------------------------------------------
def test_metrics_has_every_name_and_the_counters_move(server_url, model_name):
    before = scrape(server_url)
    complete(server_url, model_name, LONG_TEXT, 4)
    complete(server_url, model_name, LONG_TEXT, 4)           # a prefix-cache hit
    complete(server_url, model_name, "Count to ten:", 6, stream=True)
    after = scrape(server_url)

    m = {"model_name": model_name}
    for name in GAUGES:
        assert value(after, P + name, **m) >= 0
    assert 0 <= value(after, P + "kv_cache_usage_perc", **m) <= 1
    for name in ["prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total"]:
        assert value(after, P + name, **m) > value(before, P + name, **m), name
    assert value(after, P + "num_preemptions_total", **m) >= 0
    success = P + "request_success_total"
    assert value(after, success, finished_reason="length", **m) \
        >= value(before, success, finished_reason="length", **m) + 3
    for name in HISTOGRAMS:
        assert value(after, P + name + "_count", **m) > value(before, P + name + "_count", **m), name
        assert value(after, P + name + "_bucket", le="+Inf", **m) == \
            value(after, P + name + "_count", **m)
    for name in PROCESS:
        assert value(after, P + name) > 0


def test_metrics_text_parses_with_prometheus_client(server_url):
    r = httpx.get(f"{server_url}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    kinds = {P + n.removesuffix("_total"): "counter" for n in COUNTERS}
    kinds |= {P + n: "gauge" for n in GAUGES}
    kinds |= {P + n: "histogram" for n in HISTOGRAMS}
    for name, kind in kinds.items():
        assert name in families, f"{name} missing"
        assert families[name].type == kind, f"{name} is a {families[name].type}"
        assert all("model_name" in s.labels for s in families[name].samples), name
    assert not any(n.endswith("_created") for n in families), "no *_created series"


@cpu_timing
def test_metrics_answer_within_100ms_while_a_long_prefill_runs(model_name):
    """One llama_decode computes a whole 800-token prompt (a 2048-token prefill grid), and
    /metrics is timed again and again while that single decode runs. The machine is shared (2
    cores, the decode's threads on both), so the bound is on the 95th percentile; a scrape that
    waited for the decode would take as long as the decode itself (seconds)."""
    env = {"PAGEDLLAMA_PREFILL_CHUNK": "2048", "PAGEDLLAMA_MAX_BATCH_TOKENS": "2056",
           "PAGEDLLAMA_MAX_SEQS": "4", "PAGEDLLAMA_CACHE_SEQS": "2"}
    prompt = [100 + (i * 37) % 40000 for i in range(800)]
    with running_server(env) as base, httpx.Client(base_url=base, timeout=10) as http:
        http.get("/metrics")                                     # warm the connection
        prefill = threading.Thread(target=complete, args=(base, model_name, prompt, 1))
        prefill.start()
        during, steps, first, last = [], [], None, None
        while prefill.is_alive():
            t0 = time.perf_counter()
            r = http.get("/metrics")
            elapsed = time.perf_counter() - t0
            families = {f.name: f for f in text_string_to_metric_families(r.text)}
            if families[P + "num_requests_running"].samples[0].value == 1:
                step = next(s.value for s in families[P + "iteration_tokens"].samples
                            if s.name.endswith("_count"))
                steps.append(step)
                # the step counter moves when the decode ends, the running count a moment
                # later (when the worker publishes): a scrape in between is not during it
                if step == steps[0]:
                    during.append(elapsed)
                    first, last = first or t0, t0 + elapsed
            time.sleep(0.05)
        prefill.join()
    assert len(during) >= 5, "the prefill ended before /metrics could be timed during it"
    ms = sorted(1000 * t for t in during)
    p95 = ms[int(0.95 * (len(ms) - 1))]
    print(f"\n/metrics during one {last - first:.1f} s llama_decode of 800 tokens: {len(ms)} "
          f"scrapes, median {statistics.median(ms):.1f} ms, p95 {p95:.1f} ms, max {ms[-1]:.1f} ms")
    assert len(steps) - len(during) <= 1, "the scrapes should all fall inside one llama_decode"
    assert last - first > 0.5, "the prefill should be long"
    assert p95 < 100 and statistics.median(ms) < 50, ms
    assert ms[-1] < 1000 * min(0.5, (last - first) / 2), "a scrape waited for the decode"


def test_grafana_dashboard_queries_only_metrics_the_server_exports(server_url):
    exported = {key.partition("{")[0] for key in scrape(server_url)}
    dashboard = json.loads((ROOT / "docker" / "grafana-dashboard.json").read_text())
    used = set(re.findall(r"pagedllama:\w+", json.dumps(dashboard["panels"])))
    assert used and used <= exported, used - exported
    assert "localhost:8000" in (ROOT / "docker" / "prometheus.yml").read_text()


# ---- /stats ---------------------------------------------------------------------------------------
def test_stats_is_a_small_json_snapshot(server_url, model_name):
    complete(server_url, model_name, "Name three colours:", 5)
    s = httpx.get(f"{server_url}/stats", timeout=10).json()
    for key in ["active_streams", "running", "waiting", "queue_length", "tokens_per_s",
                "kv_cache_usage_perc", "prefix_cache_hit_rate", "num_preemptions",
                "cpu_percent", "ram_percent", "rss_bytes", "threads", "configured_threads"]:
        assert key in s, key
    assert 1 <= s["threads"] <= s["configured_threads"]
    assert 0 <= s["kv_cache_usage_perc"] <= 100 and 0 < s["ram_percent"] <= 100
    assert s["tokens_per_s"] > 0, "tokens were generated in the last 5 s"
    assert s["ttft_s"]["n"] >= 1 and s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]
    assert s["itl_s"]["p50"] is not None
    assert model_name in s["models"]


# ---- /dashboard ---------------------------------------------------------------------------------
def test_dashboard_is_one_self_contained_page(server_url):
    r = httpx.get(f"{server_url}/dashboard", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<canvas" in r.text
    external = re.findall(r"""(?:src|href)\s*=\s*["'](?:https?:)?//""", r.text)
    assert not external, f"the page loads something from outside: {external}"
    assert "@import" not in r.text and "url(http" not in r.text


def _load(base: str, model: str, stop: threading.Event) -> None:
    """Keep a stream or two going (with a shared prefix, so the prefix cache gets hits)."""
    while not stop.is_set():
        complete(base, model, LONG_TEXT + " Summarise this in one line:", 24, stream=True)


def _chromium():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service as DriverService

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-dev-shm-usage", "--window-size=1400,1500"]:
        opts.add_argument(arg)
    return webdriver.Chrome(options=opts, service=DriverService(CHROMEDRIVER))


# Counts the pixels of each chart's canvas in one of its series' colours: proof of drawn lines.
_INK = """
const out = {};
for (const c of window.dashboard.charts) {
  const rgb = c.spec.series.map(s => s.color.match(/\\w\\w/g).map(h => parseInt(h, 16)));
  const cv = c.canvas, d = cv.getContext('2d').getImageData(0, 0, cv.width, cv.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (rgb.some(([r, g, b]) => Math.abs(d[i] - r) < 40 && Math.abs(d[i + 1] - g) < 40
                                && Math.abs(d[i + 2] - b) < 40)) n++;
  out[c.spec.id] = {drawn: c.drawn, segments: c.segments, ink: n};
}
return out;
"""


def test_dashboard_draws_live_charts_in_chromium(server_url, model_name):
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} is missing: run `make browser` (Debian "
                    "packages chromium, chromium-driver); `make test` does it first")
    from selenium.webdriver.support.ui import WebDriverWait

    stop = threading.Event()
    loaders = [threading.Thread(target=_load, args=(server_url, model_name, stop))
               for _ in range(2)]
    for t in loaders:
        t.start()
    driver = _chromium()
    try:
        driver.get(f"{server_url}/dashboard")

        def charts_have_data(d):
            return d.execute_script(
                "const b = window.dashboard; if (!b || b.polls < 8) return false;"
                "const busy = b.history.some(p => p.s.tokens_per_s > 0 && p.s.running > 0);"
                "return busy && b.charts.every(c => c.segments >= 1);")

        WebDriverWait(driver, 180, poll_frequency=0.5).until(charts_have_data)
        ink = driver.execute_script(_INK)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        driver.save_screenshot(str(shot))
        errors = driver.execute_script("return window.dashboard.errors")
    finally:
        driver.quit()
        stop.set()
        for t in loaders:
            t.join(timeout=120)
    print(f"\ndashboard screenshot: {shot}; charts: {ink}")
    assert errors == 0
    for chart, seen in ink.items():
        assert seen["segments"] >= 1 and seen["ink"] >= 5, f"chart {chart} drew no line: {seen}"
    assert shot.stat().st_size > 10_000
