"""Each benchmark command, at a tiny size, against a real server: the report has its fields
and its counts add up (completed + failed = sent; token totals = the sum over requests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.harness.launch import find_peer_bin
from tests.server_proc import ROOT

LATENCY_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                for s in ("mean", "median", "p90", "p99", "max")]


def bench(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_SERVER_BIN"}
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def serve(server_url: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "serve.json"
    bench("serve", "--base-url", server_url, "--warmup", "0", "--disable-tqdm",
          "--result-file", str(out), *args)
    return json.loads(out.read_text())


def check_serving_report(run: dict, sent: int, output_len: int | None = None) -> None:
    assert run["sent"] == sent
    assert run["completed"] + run["failed"] == run["sent"]
    done = [r for r in run["requests"] if r["ok"]]
    assert len(done) == run["completed"] and len(run["requests"]) == run["sent"]
    assert run["total_output_tokens"] == sum(r["output_tokens"] for r in done)
    assert run["total_input_tokens"] == sum(r["prompt_tokens"] for r in done)
    if output_len is not None:
        assert all(r["output_tokens"] == output_len for r in done)
    for key in ["duration_s", "request_throughput", "output_throughput",
                "total_token_throughput", *LATENCY_KEYS]:
        assert isinstance(run[key], float) and run[key] >= 0, key
    assert run["output_throughput"] == pytest.approx(
        run["total_output_tokens"] / run["duration_s"])


def test_serve_random_prompts_report_adds_up(server_url, tmp_path):
    result = serve(server_url, tmp_path, "--dataset", "random", "--num-prompts", "3",
                   "--max-concurrency", "2", "--input-len", "24", "--output-len", "4",
                   "--ignore-eos")
    run = result["runs"][0]
    check_serving_report(run, sent=3, output_len=4)
    assert run["completed"] == 3 and run["usage_reported"]
    # calibrated by probing the server's usage: the prompts have about --input-len tokens
    assert result["calibration"]["method"] == "probe"
    assert all(20 <= r["prompt_tokens"] <= 28 for r in run["requests"])


def test_serve_shared_prefix_reuses_the_prefix(server_url, tmp_path):
    result = serve(server_url, tmp_path, "--dataset", "shared-prefix", "--num-prompts", "3",
                   "--max-concurrency", "1", "--prefix-len", "150", "--num-prefixes", "1",
                   "--input-len", "10", "--output-len", "3", "--ignore-eos", "--calibrate",
                   "approx")
    run = result["runs"][0]
    check_serving_report(run, sent=3, output_len=3)
    assert run["total_cached_tokens"] == sum(r["cached_tokens"] for r in run["requests"])


def test_serve_chat_turns_resend_the_history(server_url, tmp_path):
    result = serve(server_url, tmp_path, "--endpoint", "/v1/chat/completions", "--dataset",
                   "chat", "--num-prompts", "2", "--turns", "2", "--input-len", "12",
                   "--output-len", "3", "--ignore-eos", "--calibrate", "approx")
    run = result["runs"][0]
    check_serving_report(run, sent=2, output_len=3)
    first, second = run["requests"]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["output_tokens"]


def test_serve_sweep_reports_each_concurrency_and_plots(server_url, tmp_path):
    out = tmp_path / "sweep.json"
    bench("serve", "--base-url", server_url, "--warmup", "0", "--disable-tqdm",
          "--calibrate", "approx", "--num-prompts", "2", "--input-len", "8", "--output-len",
          "2", "--ignore-eos", "--sweep-concurrency", "1,2", "--result-file", str(out))
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_concurrency"] for r in runs] == [1, 2]
    for run in runs:
        check_serving_report(run, sent=2, output_len=2)
    assert out.with_suffix(".png").stat().st_size > 0


def test_serve_refuses_a_non_loopback_server(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--base-url",
                           "http://192.0.2.1:8000", "--num-prompts", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "loopback" in proc.stderr


def test_engine_ceiling_counts_every_token(tmp_path):
    out = tmp_path / "engine.json"
    bench("engine", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "3",
          "--result-file", str(out))
    rows = json.loads(out.read_text())["runs"]
    assert [r["n_streams"] for r in rows] == [1, 2]
    for r in rows:
        assert r["output_tokens"] == 3 * r["n_streams"]
        assert r["prompt_tokens"] == 8 * r["n_streams"]
        assert r["decode_steps"] == 2
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 and r["output_tok_s"] > 0


def test_settings_runs_each_configuration_in_alternating_rounds(tmp_path):
    out = tmp_path / "settings.json"
    proc = bench("settings", "--set", "MAX_SEQS=4", "--set", "max_seqs=1,PREFILL_CHUNK=8",
                 "--concurrency", "3", "--num-prompts", "5", "--input-len", "12",
                 "--shared-head", "4", "--output-len", "4", "--rounds", "2",
                 "--result-file", str(out))
    results = json.loads(out.read_text())["results"]
    assert [r["setting"] for r in results] == [{"MAX_SEQS": "4"},
                                               {"MAX_SEQS": "1", "PREFILL_CHUNK": "8"}]
    for r in results:
        assert len(r["rounds"]) == 2
        assert all(x["requests"] == 5 and x["output_tokens"] == 20 for x in r["rounds"])
        assert r["output_tok_s"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
    assert "MAX_SEQS=1,PREFILL_CHUNK=8" in proc.stdout and "vs first" in proc.stdout


def test_settings_refuses_what_is_not_an_engine_setting():
    from benchmarks.settings import engine_config, parse_args
    config = engine_config({"MAX_SEQS": "10"})
    assert (config.max_seqs, config.n_threads, config.adaptive_threads) == (10, 2, False)
    for bad in ("MAX_SEQ=3", "MAX_SEQS", "API_KEY=x"):
        with pytest.raises(SystemExit):
            parse_args(["--set", bad])


def test_interference_reports_gaps_and_long_prompt(server_url, tmp_path):
    out = tmp_path / "interference.json"
    bench("interference", "--base-url", server_url, "--streams", "2", "--long-len", "300",
          "--stream-output-len", "400", "--settle-tokens", "2", "--tail", "0.2",
          "--baseline", "0.3", "--warmup", "0", "--calibrate", "approx", "--result-file", str(out))
    r = json.loads(out.read_text())
    assert r["sent"] == 3 and r["completed"] + r["failed"] == r["sent"] and r["failed"] == 0
    assert 280 <= r["long_prompt_tokens"] <= 320 and r["long_output_tokens"] == 16
    assert r["long_ttft_s"] > 0
    assert r["max_gap_s"] == max(r["per_stream_max_gap_s"])
    assert r["max_gap_s"] * 1000 >= r["itl_p99_ms"] >= r["itl_p50_ms"] > 0
    # every token came in a chunk (logprobs), so the gaps are between tokens
    assert r["gaps_between"] == "tokens" and r["max_text_gap_s"] > 0
    assert all(n >= 2 for n in r["stream_output_tokens"])


def test_chunking_compares_chunked_prefill_on_and_off(tmp_path):
    out = tmp_path / "chunking.json"
    proc = bench("chunking", "--quick", "--result-file", str(out))
    r = json.loads(out.read_text())
    assert set(r["summary"]) == {"chunk 32", "off"} == set(r["runs"])
    assert r["settings"]["off"]["PAGEDLLAMA_PREFILL_CHUNK"] == "512"
    for name, runs in r["runs"].items():
        (run,) = runs
        assert run["completed"] + run["failed"] == run["sent"] == 3 and run["failed"] == 0
        assert 280 <= run["long_prompt_tokens"] <= 320
        s = r["summary"][name]
        assert s["itl_p99_ms"] >= s["itl_p50_ms"] > 0
        assert s["p99_over_p50"] == pytest.approx(s["itl_p99_ms"] / s["itl_p50_ms"])
        assert f"{name:>9}" in proc.stdout
    assert "targets: p99/p50 <= 2x" in proc.stdout


def test_repeat_compares_both_answers(server_url, tmp_path):
    out = tmp_path / "repeat.json"
    bench("repeat", "--base-url", server_url, "--num-prompts", "2", "--input-len", "80",
          "--output-len", "6", "--warmup", "0", "--calibrate", "approx",
          "--result-file", str(out))
    r = json.loads(out.read_text())
    assert r["sent"] == 4 and r["completed"] + r["failed"] == r["sent"] and r["failed"] == 0
    assert r["compared"] == 2 and r["identical"] + r["different"] == r["compared"]
    assert r["total_output_tokens"] == sum(sum(p["output_tokens"]) for p in r["prompts"])
    assert all(p["identical"] == (p["first_text"] == p["second_text"]) for p in r["prompts"])


def test_core_compares_server_with_raw_loop(tmp_path):
    out = tmp_path / "core.json"
    bench("core", "--streams", "1,2", "--input-len", "8", "--output-len", "3",
          "--disable-tqdm", "--result-file", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["streams"] for r in rows] == [1, 2]
    for r in rows:
        n = r["streams"]
        assert r["server_completed"] == n and r["server_failed"] == 0
        assert r["server_output_tokens"] == r["raw_output_tokens"] == 3 * n
        run = r["server_runs"][0]
        check_serving_report(run, sent=n, output_len=3)
        assert r["ratio"] == pytest.approx(r["server_output_tok_s"] / r["raw_output_tok_s"])
    assert [r["target"] for r in rows] == [0.9, None]


def test_speculative_compares_ours_with_and_without_drafts(tmp_path):
    out = tmp_path / "speculative.json"
    proc = bench("speculative", "--servers", "ours,ours-off", "--workloads", "extractive",
                 "--streams", "1", "--modes", "greedy", "--rounds", "1", "--slice", "2",
                 "--output-len", "12", "--result-file", str(out))
    (setting,) = json.loads(out.read_text())["settings"]
    assert (setting["workload"], setting["mode"], setting["streams"]) == ("extractive", "greedy", 1)
    ours, off = setting["servers"]["ours"], setting["servers"]["ours-off"]
    assert ours["failed"] == off["failed"] == 0 and ours["tok_s"] > 0 and off["tok_s"] > 0
    assert off["drafted"] == 0 and off["tokens_per_step"] == 1.0 and off["ratio"] == 1.0
    assert ours["drafted"] is not None and ours["tokens_per_step"] >= 1.0   # read from /stats
    assert "greedy answers identical, ours and ours-off (every run): 2 of 2" in proc.stdout


def test_speculative_reports_neither_unknown_counts_nor_failures_as_numbers():
    """A server whose counts are unknown has no tokens per step (n/a, not 1.0), and a request
    that failed on both servers is not an identical answer."""
    from benchmarks.speculative import Setting, Slice, identical, summarize, table

    def run(texts, drafted=None, accepted=None, failed=0):
        report = {"total_output_tokens": 30, "output_throughput": 10.0, "median_tpot_ms": 5.0,
                  "failed": failed}
        return [Slice(report, texts, [10.0], 1.0, drafted, accepted)]
    setting = Setting("random", "greedy", 1, {
        "ours": run(["a", None, "c"], 12, 10, failed=1),
        "ours-off": run(["a", None, "d"], 0, 0, failed=1),
        "llama-server": run(["a", "b", "c"])})
    rows = summarize(setting)
    assert rows["ours"]["tokens_per_step"] == 30 / 20 and rows["ours-off"]["tokens_per_step"] == 1.0
    assert rows["llama-server"]["tokens_per_step"] is None
    assert identical([setting], "ours", "ours-off") == (1, 3)
    assert identical([setting], "ours", "llama-server") == (2, 3)
    args = type("Args", (), {"rounds": 1, "slice": 3})
    line = next(x for x in table([setting], args).splitlines() if x.startswith("llama-server"))
    assert line.split()[6:8] == ["n/a", "n/a"]   # acceptance, tokens per step


def test_piece_cost_times_every_piece_length():
    from benchmarks.tools.piece_cost import PIECES
    proc = bench("tools.piece_cost", "--depth", "16", "--repeats", "1")
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == list(PIECES)
    for k, per_call, per_token, _ in rows:
        assert float(per_call) > 0
        assert float(per_token) == pytest.approx(float(per_call) / int(k), abs=0.011)
    assert rows[0][3] == "1.00"   # a 1-token call against itself


def test_attention_times_each_path(tmp_path):
    from benchmarks.attention import PATHS
    from engine.llama_tricks import has_row_invariant_attention
    paths = [p for p in PATHS if p != "row-invariant" or has_row_invariant_attention()]
    out = tmp_path / "attention.json"
    bench("attention", "--paths", ",".join(paths), "--prompt-len", "32", "--pieces", "16",
          "--decode", "2:24", "--steps", "2", "--rounds", "1", "--result-file", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["prompt, 16-token pieces", "decode 2 x ctx 24"]
    for r in rows:
        assert list(r["values"]) == paths and all(r["values"][p] > 0 for p in paths)
        assert all(len(r["samples"][p]) == 1 for p in paths)


def test_agent_sessions_through_the_messages_api_against_ours_alone(server_url, tmp_path):
    out = tmp_path / "agent.json"
    bench("scripted_agent", "--quick", "--ours", server_url, "--peer", "none", "--result-file", str(out))
    level = json.loads(out.read_text())["levels"]["1"]
    first, second = level["per_turn"]["pagedllama"]
    assert first["completed"] == second["completed"] == 1
    assert second["input_tokens"] > first["input_tokens"] > 500   # the history grew
    assert second["cached_tokens"] >= first["input_tokens"] - 16  # the first turn came back
    assert any("cached >= 90% of input" in t for t in level["targets"])


def test_agent_refuses_a_non_loopback_peer():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scripted_agent", "--ours", "http://127.0.0.1:9",
                           "--peer", "http://192.0.2.1:8000"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "loopback" in proc.stderr


def test_compare_without_peer_binary_skips_cleanly():
    proc = bench("compare", "--peer-bin", "/nonexistent/llama-server", timeout=60)
    assert "SKIPPED" in proc.stdout and "/nonexistent/llama-server" in proc.stdout
    assert "build_llama_server.sh" in proc.stdout


@pytest.mark.skipif(find_peer_bin() is None,
                    reason="no llama-server binary (see docs/benchmarks.md)")
def test_compare_against_llama_server_tiny(tmp_path):
    out = tmp_path / "compare.json"
    bench("compare", "--peer-bin", str(find_peer_bin()), "--parallel", "3",
          "--input-len", "8", "--output-len", "3", "--single-prompts", "1",
          "--concurrent-prompts", "2", "--prefix-len", "80", "--num-prefixes", "1",
          "--question-len", "8", "--prefix-output-len", "2", "--prefix-prompts", "2",
          "--interference-streams", "2", "--interference-stream-output-len", "300",
          "--long-len", "150", "--repeat-prompts", "1",
          "--repeat-input-len", "80", "--repeat-output-len", "4", "--disable-tqdm",
          "--result-file", str(out), timeout=600)
    r = json.loads(out.read_text())
    for side in ("ours", "peer"):
        for wl, runs in r["results"][side].items():
            assert len(runs) == 1
            assert runs[0]["completed"] + runs[0]["failed"] == runs[0]["sent"], (side, wl)
            assert runs[0]["failed"] == 0, (side, wl, runs[0].get("errors"))
    assert {row["label"] for row in r["comparison"]} >= {"random, 1 stream: output tok/s"}


def test_cluster_compares_routing_by_key_and_round_robin(tmp_path):
    out = tmp_path / "cluster.json"
    # session (routing by key) is the policy with code of its own here (each request's key in a
    # header); the others are only the router's setting
    proc = bench("cluster", "--quick", "--policies", "session,round_robin",
                 "--result-file", str(out))
    r = json.loads(out.read_text())
    assert set(r["summary"]) == {"round_robin", "session"}
    for (run,) in r["runs"].values():
        assert run["completed"] + run["failed"] == run["sent"] == 8 and run["failed"] == 0
        assert sum(run["requests_per_replica"]) == 8
        assert 0 < run["prefix_hit_rate"] < 1
        # each replica's time in llama_decode, from its /health: within the run, and some in
        # all (cache-aware routing may leave a replica idle in so small a run)
        assert len(run["decode_s_per_replica"]) == 2
        assert all(0 <= d <= run["duration_s"] + 0.5 for d in run["decode_s_per_replica"])
        assert sum(run["decode_s_per_replica"]) > 0
        assert all(p >= 0 for p in run["step_python_s_per_replica"])
    assert r["runs"]["round_robin"][0]["requests_per_replica"] == [4, 4]
    assert "session / round_robin throughput" in proc.stdout


def test_paired_alternates_slices_and_reports_ratios(server_url, tmp_path):
    """One server as both A and B (tiny): every slice completes, each pair has a ratio."""
    out = tmp_path / "paired.json"
    proc = bench("paired", "--a", server_url, "--b", server_url, "--pairs", "3", "--slice", "2",
                 "--concurrency", "2", "--input-len", "16", "--output-len", "4",
                 "--temperature", "1.0", "--sampling", "top_p=0.9", "--sampling", "top_k=20",
                 "--result-file", str(out))
    assert "temperature=1 top_p=0.9 top_k=20" in proc.stdout
    result = json.loads(out.read_text())
    for who in ("A", "B"):
        assert result[who]["output_tokens"] == [8, 8, 8] and result[who]["failed"] == 0
        assert all(x > 0 for x in result[who]["tok_s"])
    assert len(result["ratios"]) == 3 and result["median_ratio"] > 0
    assert "A/B tok/s per pair" in proc.stdout


def test_paired_order_and_settings():
    from benchmarks.harness.launch import parse_env
    from benchmarks.paired import parse_sampling, slice_order
    assert parse_sampling(["top_p=0.95", "top_k=40", "min_p=0.05"]) == {
        "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    for bad in ("top_p", "top_q=0.9", "top_k=0.5"):
        with pytest.raises(SystemExit):
            parse_sampling([bad])
    assert slice_order(4) == [("A", "B"), ("B", "A"), ("A", "B"), ("B", "A")]
    assert parse_env(["PAGEDLLAMA_FLASH_ATTN=1", "PAGEDLLAMA_MAX_SEQS=10"]) == {
        "PAGEDLLAMA_FLASH_ATTN": "1", "PAGEDLLAMA_MAX_SEQS": "10"}
    for bad in ("FLASH_ATTN=1", "PAGEDLLAMA_X"):
        with pytest.raises(SystemExit):
            parse_env([bad])


def test_paired_table_shows_whole_server_names():
    from types import SimpleNamespace

    from benchmarks.paired import table
    row = {"median_tok_s": 1.0, "median_ttft_ms": 2.0, "median_prompt_tok_s": 5.0,
           "median_tpot_ms": 3.0, "p99_itl_ms": 4.0, "failed": 0}
    names = {"A": "ours PAGEDLLAMA_FLASH_ATTN=1 PAGEDLLAMA_PREFILL_CHUNK=64", "B": "llama-server"}
    args = SimpleNamespace(workload="chat", pairs=1, slice=2, concurrency=2, input_len=8,
                           output_len=4, temperature=0.0, sampling=[])
    text = table({"A": row, "B": row, "ratios": [1.0], "median_ratio": 1.0,
                  "ttft_ratios": [1.0], "median_ttft_ratio": 1.0}, names, args)
    assert names["A"] + " " in text
    header, a, b = text.splitlines()[1:4]
    assert len(a) == len(b) and header.index("tok/s") + len("tok/s") == a.index("1.0") + 3


def _guidellm_level(streams: int, tok_s: float, tokens: int) -> dict:
    """One level of a guidellm 0.8 JSON report, as much of it as benchmarks.guidellm_pairs reads."""
    def dist(median, p99, mean=None):
        return {"successful": {"median": median, "mean": mean if mean is not None else median,
                               "percentiles": {"p50": median, "p99": p99}}}
    return {"config": {"strategy": {"type_": "concurrent", "streams": streams}},
            "metrics": {"output_tokens_per_second": dist(tok_s * 0.9, tok_s * 2, mean=tok_s),
                        "output_token_count": {"successful": {"total_sum": float(tokens)}},
                        "inter_token_latency_ms": dist(10.0 * streams, 20.0 * streams),
                        "time_to_first_token_ms": dist(300.0, 900.0)}}


def test_guidellm_pairs_command_order_and_summary():
    from benchmarks.guidellm_pairs import (
        guidellm_command,
        parse_args,
        read_levels,
        run_order,
        summarize,
        table,
    )
    args = parse_args(["--streams", "1,16", "--prefix-tokens", "512", "--requests", "32",
                       "--a-env", "PAGEDLLAMA_ADAPTIVE_THREADS=0"])
    assert args.levels == [1, 16]
    cmd = guidellm_command(args, "http://127.0.0.1:9", "m", Path("/tmp/out.json"))
    assert cmd[cmd.index("--profile") + 1] == "kind=concurrent,streams[0]=1,streams[1]=16"
    assert "prefix_tokens=512,prefix_count=1" in cmd[cmd.index("--data") + 1]
    assert "kind=max_requests,count=32" in cmd and "target=http://127.0.0.1:9" in " ".join(cmd)
    with pytest.raises(SystemExit):   # settings only for our own server
        parse_args(["--b-env", "PAGEDLLAMA_ADAPTIVE_THREADS=0"])
    assert run_order(3) == [(0, "A"), (0, "B"), (1, "B"), (1, "A"), (2, "A"), (2, "B")]

    def run(tok_1, tok_16, cpu):
        report = {"benchmarks": [_guidellm_level(1, tok_1, 3072), _guidellm_level(16, tok_16, 3072)]}
        return {"levels": read_levels(report), "server_cpu_s": cpu, "client_cpu_s": 20.0,
                "server_cpu_ms_per_token": 1000 * cpu / 6144}
    levels = run(40.0, 100.0, 61.44)["levels"]
    assert levels[1] == {"streams": 16, "tok_s": 100.0, "output_tokens": 3072.0, "itl_p50": 160.0,
                         "itl_p99": 320.0, "ttft_p50": 300.0, "ttft_p99": 900.0}
    runs = {"A": [run(40.0, 100.0, 61.44), run(45.0, 90.0, 61.44)],
            "B": [run(50.0, 100.0, 55.0), run(45.0, 100.0, 55.0)]}
    rows = summarize(runs)
    assert [r["streams"] for r in rows] == [1, 16]
    assert rows[0]["ratios"] == [0.8, 1.0] and rows[0]["ratio_median"] == pytest.approx(0.9)
    assert rows[1]["ratios"] == [1.0, 0.9] and rows[1]["a_tok_s"] == 95.0
    text = table(rows, runs, {"A": "ours", "B": "llama-server"})
    assert "0.80 1.00" in text and "0.900x" in text and "10.0, 10.0" in text


def test_sizes_measures_each_part_on_our_server_alone(tmp_path):
    out = tmp_path / "sizes.json"
    proc = bench("sizes", "--quick", "--servers", "ours", "--models", "models/SmolLM2-135M-Instruct.Q4_1.gguf",
                 "--prompt-len", "60", "--depths", "80,9000", "--short-len", "16", "--decode-tokens", "4",
                 "--streams", "2", "--chat-prompts", "2", "--chat-input-len", "16", "--chat-output-len", "4",
                 "--chat-ctx", "256", "--result-file", str(out))
    (r,) = json.loads(out.read_text())["results"]
    assert r["depths"] == [80] and r["depths_beyond_context"] == [9000] and not r["random_weights"]
    long, conc = r["settings"]["long"], r["settings"]["concurrent"]
    assert (long["parallel"], conc["parallel"], conc["n_ctx"]) == (1, 2, 256) and "peer" not in long
    ours = long["ours"]
    assert 50 <= ours["prompt"]["prompt_tokens"] <= 70 and ours["prompt"]["ttft_s"] > 0
    assert [d["output_tokens"] for d in ours["decode"]] == [4, 4]
    assert all(d["decode_tok_s"] > 0 for d in ours["decode"])
    chats = conc["ours"]["concurrent"]
    assert chats["completed"] == 2 and chats["total_output_tokens"] == 8 and chats["failed"] == 0
    assert ours["memory"]["peak"] >= ours["memory"]["rss_start"] > 0
    assert "depths 9000 skipped" in proc.stdout and "decode, 1 stream, after" in proc.stdout


@pytest.mark.skipif(find_peer_bin() is None,
                    reason="no llama-server binary (see docs/benchmarks.md)")
def test_sizes_against_llama_server_tiny(tmp_path):
    out = tmp_path / "sizes.json"
    bench("sizes", "--quick", "--peer-bin", str(find_peer_bin()), "--models",
          "models/SmolLM2-135M-Instruct.Q4_1.gguf", "--prompt-len", "60", "--depths", "80", "--short-len", "16",
          "--decode-tokens", "4", "--streams", "2", "--chat-prompts", "2", "--chat-input-len", "16",
          "--chat-output-len", "4", "--chat-ctx", "256", "--result-file", str(out), timeout=600)
    (r,) = json.loads(out.read_text())["results"]
    for setting in r["settings"].values():
        assert setting["ours"]["memory"]["peak"] > 0 and setting["peer"]["memory"]["peak"] > 0
    for side in ("ours", "peer"):
        assert [d["output_tokens"] for d in r["settings"]["long"][side]["decode"]] == [4, 4]
    rows = json.loads(out.read_text())["comparison"][r["name"]]
    assert rows and all(row["ratio"] is not None and row["ratio"] > 0 for row in rows)


def test_models_kv_compares_q8_0_with_f16_per_token(tmp_path):
    out = tmp_path / "kv.json"
    proc = bench("models", "kv", "--kv-tokens", "4", "--result-file", str(out))
    r = json.loads(out.read_text())
    f16, q8 = r["memory"]["f16"], r["memory"]["q8_0"]
    assert q8["seqs_per_gib"] == pytest.approx(f16["seqs_per_gib"] * 32 / 17)
    quality = r["quality"]
    assert quality["prompts"] == 16 and quality["tokens"] == 4
    # q8_0 generating on its own leaves f16's answer exactly at the first position where, teacher-
    # forced along that answer, its argmax differs: the prompts whose answers differ are the
    # prompts with a disagreeing position (at least one, at most `tokens` each)
    disagreeing = round((1 - quality["token_agreement"]) * 16 * 4)
    assert -(-disagreeing // 4) <= 16 - quality["same_answers"] <= disagreeing
    assert 0 <= quality["kl_mean"] <= quality["kl_max"] and 0 < quality["token_agreement"] <= 1
    assert "KL mean" in proc.stdout


def test_models_lifecycle_times_loads_and_unloads_cold_and_warm(tmp_path):
    out = tmp_path / "lifecycle.json"
    bench("models", "lifecycle", "--repeats", "1", "--parallel", "2", "--n-ctx", "256",
          "--peer-bin", "/nonexistent/llama-server", "--result-file", str(out), timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert {(r["model"], r["page_cache"]) for r in rows} == {
        (m, c) for m in ("SmolLM2-135M-Instruct.Q4_1", "gemma-3-270m-q4_k_m")
        for c in ("cold", "warm")}
    assert all(r["server"] == "ours" and r["load_s"] > 0 and r["unload_s"] > 0
               and r["request_that_loads_s"] > 0 and 0 <= r["cached_share"] <= 1 for r in rows)


def test_batch_measures_chats_beside_a_batch_and_the_batch_against_a_client(tmp_path):
    out = tmp_path / "batch.json"
    bench("batch", "--quick", "--result-file", str(out))
    r = json.loads(out.read_text())
    assert r["failed"] == 0 and len(r["rounds"]) == 1
    rd = r["rounds"][0]
    for run in (rd["interactive_alone"], rd["interactive_beside_batch"]):
        assert run["completed"] == run["sent"] == 3 and run["ttft_p95_ms"] > 0
    assert rd["interactive_beside_batch"]["batch_lines_done"] >= 0
    assert rd["batch_alone"]["status"] == "completed" and rd["batch_alone"]["completed"] == 4
    assert rd["batch_alone"]["output_tokens"] == 4 * 6          # ignore_eos: every line its 6
    assert rd["client_best"]["completed"] == 4
    assert set(r["client_sweep"]) == {"1", "2"} and str(r["best_concurrency"]) in r["client_sweep"]
    assert r["ratios"] == rd["ratios"] and len(r["ratios"]) == 4
    assert all(isinstance(x, float) and x > 0 for x in r["ratios"].values())
    assert all(x > 0 for x in r["pooled"]["ratios"].values())


def test_new_session_tiers_are_read_from_the_servers_request_log():
    from benchmarks.agents import Exchange, tiers_from_log
    log = ("INFO pagedllama.server: POST /v1/messages ok model=m prompt=900 cached=0 "
           "prompt_steps=3 completion=8 ttft=1.0s total=1.2s finish=length\n"
           "INFO pagedllama.server: POST /v1/messages ok model=m prompt=1000 cached=832 "
           "cached_from=disk prompt_steps=1 completion=8 ttft=0.2s total=0.3s finish=length\n"
           "INFO pagedllama.server: POST /v1/chat/completions ok model=m prompt=1000 cached=832 "
           "cached_from=ram prompt_steps=1 completion=8 ttft=0.2s total=0.3s finish=length\n")
    chat = Exchange("opencode", 1, "POST", "/v1/chat/completions", prompt=1000, cached=832)
    second = Exchange("claude", 1, "POST", "/v1/messages?beta=true", prompt=1000, cached=832)
    first = Exchange("claude", 1, "POST", "/v1/messages?beta=true", prompt=900, cached=0)
    tiers_from_log(log, [chat, second, first])
    assert (chat.cached_from, second.cached_from, first.cached_from) == ("ram", "disk", None)


def test_new_session_report_compares_b_with_its_own_cold_time(capsys):
    from benchmarks.agents import Exchange, report_sessions
    a = Exchange("claude", 1, "POST", "/v1/messages", status=200, prompt=1000, cached=0, ttft=9.0)
    title = Exchange("claude", 1, "POST", "/v1/messages", status=200, prompt=80, cached=0,
                     ttft=0.5, session="B")
    b = Exchange("claude", 1, "POST", "/v1/messages", status=200, prompt=1100, cached=900,
                 ttft=2.0, session="B", cached_from="disk")
    a.session = "A"
    cold = Exchange("claude", 1, "POST", "/v1/messages", status=200, prompt=1100, cached=0,
                    ttft=10.0, session="cold")
    summary = report_sessions([a, title, b], ["claude"], {"claude": cold})
    line = summary["agents"][0]
    assert (line["prompt_b"], line["cached_pct_b"], line["cached_from_b"]) == (1100, 81.8, "disk")
    assert (line["ttft_ratio"], line["ttft_b_cold_s"], line["ttft_ratio_cold"]) == (0.222, 10.0, 0.2)
    assert "0.2x its cold time" in capsys.readouterr().out


def test_ollama_routes_side_by_side(server_url, tmp_path):
    """/api/chat and /v1/chat/completions on one server, tiny: both routes generate the same
    greedy tokens in each rep, the order alternates, each rep has a ratio."""
    out = tmp_path / "ollama.json"
    proc = bench("ollama", "--base-url", server_url, "--reps", "2", "--concurrency", "2",
                 "--input-len", "16", "--output-len", "4", "--result-file", str(out))
    result = json.loads(out.read_text())
    assert result["ollama"]["output_tokens"] == result["openai"]["output_tokens"]
    assert all(0 < n <= 8 for n in result["ollama"]["output_tokens"])
    assert result["same_answers"] == [True, True]
    assert result["ollama"]["failed"] == result["openai"]["failed"] == 0
    assert len(result["ratios"]) == 2 and result["median_ratio"] > 0
    assert "ollama/openai tok/s per rep" in proc.stdout
    assert proc.stderr.index("rep 1 ollama") < proc.stderr.index("rep 1 openai")
    assert proc.stderr.index("rep 2 openai") < proc.stderr.index("rep 2 ollama")
