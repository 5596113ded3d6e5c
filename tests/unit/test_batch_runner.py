"""The Batch API's runner (server/batch/runner.py) over a real store and a stand-in for the
routes: every line runs once to an answer, a restart resumes where the last process stopped,
busy answers run again, and the runner stays out of interactive requests' way."""
import asyncio
import json
import time
from types import SimpleNamespace

import pytest

from server.batch import runner as runner_module
from server.batch.runner import BatchRunner
from server.config import BatchSettings
from server.http.errors import APIError

CHAT = "/v1/chat/completions"


def jsonl(*cids: str) -> bytes:
    return "".join(json.dumps({"custom_id": c, "method": "POST", "url": CHAT, "body": {
        "model": "m", "messages": [{"role": "user", "content": c}]}}) + "\n"
        for c in cids).encode()


class Worker:
    def __init__(self):
        self.waiting = 0

    def snapshot(self):
        return SimpleNamespace(waiting=self.waiting)


def service(loaded: bool = True):
    """A service with one model `m` (loaded: lines may run side by side)."""
    lm = SimpleNamespace(preparing=0, workers=[Worker()]) if loaded else None
    entry = SimpleNamespace(users=0, loaded=lm)
    return SimpleNamespace(catalog=SimpleNamespace(entries={"m": entry}), closing=False)


class Routes:
    """Stands in for server/api/batches.py's answer_line: each line's answer names its
    custom_id; `hold` lines wait until released (or cancelled: a 499, as the routes answer a
    client that left); `fail` maps a custom_id to the APIErrors it raises, in turn."""

    def __init__(self, hold=(), fail=None):
        self.calls: list[str] = []
        self.hold, self.fail = set(hold), {k: list(v) for k, v in (fail or {}).items()}
        self.release = asyncio.Event()
        self.pad = 0             # characters of padding in each answer

    async def __call__(self, endpoint, body, http):
        cid = body["messages"][0]["content"]
        self.calls.append(cid)
        await asyncio.sleep(0.005)
        if self.fail.get(cid):
            raise self.fail[cid].pop(0)
        while cid in self.hold and not self.release.is_set():
            if await http.is_disconnected():
                raise APIError(499, "client disconnected", "client_disconnected")
            await asyncio.sleep(0.01)
        return {"answer": cid, "pad": "x" * self.pad, "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 8}}}


def make(tmp_path, routes, svc=None, concurrency=4, clock=time.time) -> BatchRunner:
    return BatchRunner(BatchSettings(state_dir=tmp_path, concurrency=concurrency),
                       svc or service(), SimpleNamespace(draining=False), routes,
                       clock=clock)


async def submit(runner, content: bytes, window_s: float = 86400) -> str:
    f = await runner.upload("batch", "in.jsonl", content, content.count(b"\n"))
    return (await runner.create(CHAT, f["id"], "24h", window_s, None))["id"]


async def until(runner, bid, *statuses, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = await runner.batch(bid)
        if row["status"] in statuses:
            return row
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch {bid} is {row['status']}, not {statuses}")


async def lines_of(runner, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (await runner.file_content(file_id)).decode().splitlines()]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_a_batch_runs_every_line_once_and_completes(tmp_path):
    async def main():
        routes = Routes()
        r = make(tmp_path, routes)
        await r.start()
        bid = await submit(r, jsonl(*[f"r{i}" for i in range(12)]))
        row = await until(r, bid, "completed")
        out = await lines_of(r, row["output_file_id"])
        stats = r.stats()
        with pytest.raises(APIError) as ended:
            await r.cancel(bid)
        await r.stop()
        return routes, row, out, stats, ended.value

    routes, row, out, stats, ended = run(main())
    assert sorted(routes.calls) == sorted(f"r{i}" for i in range(12))
    assert [x["custom_id"] for x in out] == [f"r{i}" for i in range(12)]
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert (row["completed"], row["failed"], row["total"]) == (12, 0, 12)
    assert (row["input_tokens"], row["cached_tokens"], row["output_tokens"]) == (120, 96, 24)
    assert row["error_file_id"] is None and row["completed_at"] >= row["in_progress_at"]
    assert stats["lines_completed"] == 12 and stats["completion_tokens"] == 24
    assert ended.status == 409 and ended.code == "batch_not_cancellable"


def test_a_restart_resumes_the_batch_and_runs_no_finished_line_again(tmp_path):
    cids = [f"r{i}" for i in range(8)]

    async def first_process():
        routes = Routes(hold=cids[2:])
        r = make(tmp_path, routes)
        await r.start()
        bid = await submit(r, jsonl(*cids))
        while (await r.batch(bid))["completed"] < 2 or r.stats()["lines_running"] < 4:
            await asyncio.sleep(0.01)
        await r.stop()            # as a crash: the running lines stay running in the store
        return bid, routes

    async def second_process(bid):
        routes = Routes()
        r = make(tmp_path, routes)
        await r.start()           # the store exists: the batch resumes at once
        row = await until(r, bid, "completed")
        out = await lines_of(r, row["output_file_id"])
        await r.stop()
        return routes, out

    bid, first = run(first_process())
    second, out = run(second_process(bid))
    assert set(second.calls) == set(cids) - {"r0", "r1"}
    assert len(second.calls) == len(set(second.calls))
    assert sorted(x["custom_id"] for x in out) == cids      # each line exactly once


def test_a_line_the_server_was_too_busy_for_runs_again(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "BUSY_PAUSE_S", 0.05)

    async def main():
        routes = Routes(fail={"r1": [APIError(429, "busy", "rate_limit_exceeded"),
                                     APIError(503, "loading", "model_loading")]})
        r = make(tmp_path, routes)
        await r.start()
        bid = await submit(r, jsonl("r0", "r1", "r2"))
        row = await until(r, bid, "completed")
        out = await lines_of(r, row["output_file_id"])
        await r.stop()
        return routes, out

    routes, out = run(main())
    assert routes.calls.count("r1") == 3
    assert sorted(x["custom_id"] for x in out) == ["r0", "r1", "r2"]


def test_a_line_its_route_refuses_goes_to_the_error_file_with_the_routes_error(tmp_path):
    error = APIError(400, "messages: bad", "invalid_value", "messages")

    async def main():
        r = make(tmp_path, Routes(fail={"bad": [error]}))
        await r.start()
        bid = await submit(r, jsonl("ok", "bad"))
        row = await until(r, bid, "completed")
        result = row, await lines_of(r, row["output_file_id"]), await lines_of(
            r, row["error_file_id"])
        await r.stop()
        return result

    row, out, err = run(main())
    assert (row["completed"], row["failed"]) == (1, 1)
    assert [x["custom_id"] for x in out] == ["ok"]
    assert err[0]["custom_id"] == "bad" and err[0]["response"]["status_code"] == 400
    assert err[0]["response"]["body"] == error.body()


def test_no_line_starts_while_an_interactive_request_holds_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "QUIET_S", 0.1)
    svc = service()

    async def main():
        routes = Routes()
        r = make(tmp_path, routes, svc)
        await r.start()
        svc.catalog.entries["m"].users = 1          # a client's request holds the model
        bid = await submit(r, jsonl("r0", "r1"))
        await until(r, bid, "in_progress")
        await asyncio.sleep(0.4)
        held = list(routes.calls)
        svc.catalog.entries["m"].users = 0
        await until(r, bid, "completed")
        await r.stop()
        return held, routes.calls

    held, calls = run(main())
    assert held == [] and sorted(calls) == ["r0", "r1"]


def test_no_line_starts_while_a_request_waits_in_the_models_context(tmp_path):
    svc = service()

    async def main():
        routes = Routes()
        r = make(tmp_path, routes, svc)
        await r.start()
        svc.catalog.entries["m"].loaded.workers[0].waiting = 1
        bid = await submit(r, jsonl("r0"))
        await until(r, bid, "in_progress")
        await asyncio.sleep(0.3)
        held = list(routes.calls)
        svc.catalog.entries["m"].loaded.workers[0].waiting = 0
        await until(r, bid, "completed")
        await r.stop()
        return held

    assert run(main()) == []


def test_lines_in_flight_stay_within_the_concurrency(tmp_path):
    async def main():
        routes = Routes(hold=[f"r{i}" for i in range(10)])
        r = make(tmp_path, routes, concurrency=3)
        await r.start()
        bid = await submit(r, jsonl(*[f"r{i}" for i in range(10)]))
        peak = 0
        for _ in range(50):
            peak = max(peak, r.stats()["lines_running"])
            await asyncio.sleep(0.01)
        routes.release.set()
        await until(r, bid, "completed")
        await r.stop()
        return peak

    assert run(main()) == 3


def test_a_cancelled_batch_ends_with_the_lines_it_finished(tmp_path):
    async def main():
        routes = Routes(hold=["r2", "r3"])
        r = make(tmp_path, routes)
        await r.start()
        bid = await submit(r, jsonl("r0", "r1", "r2", "r3"))
        while (await r.batch(bid))["completed"] < 2:
            await asyncio.sleep(0.01)
        assert (await r.cancel(bid))["status"] == "cancelling"
        row = await until(r, bid, "cancelled")
        result = row, await lines_of(r, row["output_file_id"]), await lines_of(
            r, row["error_file_id"])
        assert (await r.cancel(bid))["status"] == "cancelled"     # cancelling again: as it is
        await r.stop()
        return result

    row, out, err = run(main())
    assert [x["custom_id"] for x in out] == ["r0", "r1"]
    assert [(x["custom_id"], x["error"]["code"]) for x in err] == [
        ("r2", "batch_cancelled"), ("r3", "batch_cancelled")]
    assert (row["completed"], row["failed"], row["total"]) == (2, 2, 4)


def test_a_batch_past_its_completion_window_expires(tmp_path):
    now = [1_000_000.0]

    async def main():
        routes = Routes(hold=["r1"])
        r = make(tmp_path, routes, clock=lambda: now[0])
        await r.start()
        bid = await submit(r, jsonl("r0", "r1"), window_s=60)
        while (await r.batch(bid))["completed"] < 1:
            await asyncio.sleep(0.01)
        now[0] += 61
        row = await until(r, bid, "expired")
        err = await lines_of(r, row["error_file_id"])
        await r.stop()
        return row, err

    row, err = run(main())
    assert row["expired_at"] == 1_000_061 and row["completed"] == 1
    assert [(x["custom_id"], x["error"]["code"]) for x in err] == [("r1", "batch_expired")]


def test_a_full_disk_fails_the_batch_with_a_clear_error_and_the_runner_goes_on(tmp_path):
    async def main():
        routes = Routes(hold=["r0"])
        r = make(tmp_path, routes)
        await r.start()
        bid = await submit(r, jsonl("r0", "r1"))
        await until(r, bid, "in_progress")
        store = await r.open()
        with store._mutex:     # SQLite's SQLITE_FULL, as a full disk
            pages = store.db.execute("PRAGMA page_count").fetchone()[0]
            store.db.execute(f"PRAGMA max_page_count={pages}")
        routes.pad = 300_000     # r0's answer no longer fits
        routes.release.set()
        row = await until(r, bid, "failed")
        routes.pad = 0
        with store._mutex:
            store.db.execute("PRAGMA max_page_count=1073741823")
        other = await submit(r, jsonl("s0"))
        done = await until(r, other, "completed")
        await r.stop()
        return row, done

    row, done = run(main())
    assert row["errors"] and json.loads(row["errors"])[0]["code"] == "storage_full"
    assert "disk is full" in json.loads(row["errors"])[0]["message"]
    assert done["completed"] == 1


def test_an_input_file_with_bad_lines_fails_validation_with_their_numbers(tmp_path):
    async def main():
        routes = Routes()
        r = make(tmp_path, routes)
        await r.start()
        bid = await submit(r, jsonl("a") + b"{oops\n" + jsonl("a"))
        row = await until(r, bid, "failed")
        await r.stop()
        return row, routes.calls

    row, calls = run(main())
    errors = json.loads(row["errors"])
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json"),
                                                        (3, "duplicate_custom_id")]
    assert calls == [] and row["total"] == 0


def test_a_batch_beyond_the_limits_is_a_clear_4xx(tmp_path):
    async def main():
        r = BatchRunner(BatchSettings(state_dir=tmp_path, max_lines=2, max_active=1), service(),
                        SimpleNamespace(draining=False), Routes(hold=["a"]))
        await r.start()
        big = await r.upload("batch", "big.jsonl", jsonl("a", "b", "c"), 3)
        errors = []
        for args in ((big["id"],), ("file-nope",)):
            with pytest.raises(APIError) as err:
                await r.create(CHAT, *args, "24h", 60, None)
            errors.append(err.value)
        ok = await r.upload("batch", "ok.jsonl", jsonl("a"), 1)
        await r.create(CHAT, ok["id"], "24h", 60, None)
        with pytest.raises(APIError) as err:
            await r.create(CHAT, ok["id"], "24h", 60, None)
        errors.append(err.value)
        await r.stop()
        return errors

    too_many, missing, active = run(main())
    assert (too_many.status, too_many.code, too_many.param) == (400, "too_many_lines",
                                                                "input_file_id")
    assert "PAGEDLLAMA_BATCH_MAX_LINES" in too_many.message
    assert (missing.status, missing.code) == (404, "file_not_found")
    assert (active.status, active.code) == (429, "too_many_active_batches")
    assert "PAGEDLLAMA_BATCH_MAX_ACTIVE" in active.message


def test_uploads_have_their_own_body_limit_at_the_edge():
    from server.config import EdgeLimits
    from server.http.edge import body_limit

    limits = EdgeLimits(max_body_bytes=1000, max_upload_bytes=5000)
    assert body_limit({"path": "/v1/files", "method": "POST"}, limits) == (
        5000, "PAGEDLLAMA_BATCH_MAX_FILE_BYTES")
    assert body_limit({"path": "/v1/batches", "method": "POST"}, limits)[0] == 1000
    assert body_limit({"path": "/v1/chat/completions", "method": "POST"}, limits)[0] == 1000


def test_a_store_failure_reaches_the_client_as_a_clear_error_in_openais_shape():
    from server.api.batches import _stored
    from server.batch.store import StorageError

    async def failing(code):
        raise StorageError(f"storing a file: {code}", code)

    errors = {}
    for code in ("storage_full", "storage_busy", "storage_corrupt"):
        with pytest.raises(APIError) as err:
            asyncio.run(_stored(failing(code)))
        errors[code] = err.value
    assert (errors["storage_full"].status, errors["storage_full"].code) == (507, "storage_full")
    assert errors["storage_full"].body()["error"]["type"] == "server_error"
    assert all(errors[c].status == 503 and errors[c].code == "batch_store_unavailable"
               for c in ("storage_busy", "storage_corrupt"))
    assert "storage_busy" in errors["storage_busy"].message
