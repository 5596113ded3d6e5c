"""The Batch API's store (server/batch/store.py) and its input and output shapes
(server/batch/shapes.py): a line is recorded once, a crash leaves nothing lost and nothing
recorded twice, and a corrupt file, a full disk or a second process are clear errors."""
import json

import pytest

from server.batch import shapes
from server.batch.store import DB_NAME, DONE, PENDING, RUNNING, StorageError, Store

CHAT = "/v1/chat/completions"


def request_line(cid: str, url: str = CHAT, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"model": "m", "messages": [{"role": "user", "content": cid}],
                                **body}})


def started(store: Store, n: int = 5) -> str:
    """A batch of n lines (custom ids r1..rn), in progress."""
    f = store.add_file("batch", "in.jsonl", b"x", n)
    b = store.add_batch(CHAT, f["id"], "24h", 86400, None)
    lines = [(i, f"r{i}", request_line(f"r{i}")) for i in range(1, n + 1)]
    assert store.start_batch(b["id"], lines, "m")
    return b["id"]


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path)
    yield s
    s.close()


def test_a_line_is_recorded_once_however_often_it_finishes(store):
    bid = started(store, 2)
    assert store.mark_running(bid, 1)
    assert store.finish_line(bid, 1, True, '{"a": 1}', (10, 2, 5, 0))
    assert not store.finish_line(bid, 1, True, '{"a": 2}', (10, 2, 5, 0))
    row = store.batch(bid)
    assert (row["completed"], row["failed"], row["input_tokens"], row["cached_tokens"],
            row["output_tokens"]) == (1, 0, 10, 2, 5)
    assert store.line_states(bid) == {PENDING: 1, DONE: 1}


def test_a_crash_reruns_the_lines_in_flight_and_not_the_done_ones(tmp_path):
    store = Store(tmp_path)
    bid = started(store, 5)
    for idx in (1, 2):
        store.mark_running(bid, idx)
        store.finish_line(bid, idx, True, f'{{"line": {idx}}}')
    for idx in (3, 4):
        store.mark_running(bid, idx)
    store.db.close()            # the process dies: nothing else runs, the lock goes with it
    store._unlock()

    again = Store(tmp_path)
    try:
        assert again.recover() == 2
        assert [idx for idx, _, _ in again.pending_lines(bid)] == [3, 4, 5]
        assert again.line_states(bid) == {PENDING: 3, DONE: 2}
        assert again.batch(bid)["completed"] == 2
        assert [b["id"] for b in again.active_batches()] == [bid]
    finally:
        again.close()


def test_a_line_released_after_a_busy_server_is_pending_again(store):
    bid = started(store, 1)
    store.mark_running(bid, 1)
    assert store.line_states(bid) == {RUNNING: 1}
    assert store.release_line(bid, 1)
    assert store.pending_lines(bid)[0][0] == 1


def test_finalize_writes_output_and_error_files_in_input_order(store):
    bid = started(store, 4)
    for idx, ok in ((3, True), (1, True), (2, False)):
        store.finish_line(bid, idx, ok, json.dumps({"line": idx}))
    row = store.finalize(bid, "cancelled", unfinished=lambda idx, cid: json.dumps(
        {"line": idx, "why": "cancelled"}))
    assert row["status"] == "cancelled" and row["cancelled_at"] is not None
    out = store.file_content(row["output_file_id"]).decode().splitlines()
    err = store.file_content(row["error_file_id"]).decode().splitlines()
    assert [json.loads(x)["line"] for x in out] == [1, 3]
    assert [json.loads(x) for x in err] == [{"line": 2}, {"line": 4, "why": "cancelled"}]
    assert (row["completed"], row["failed"], row["total"]) == (2, 2, 4)
    assert store.file(row["output_file_id"])["purpose"] == "batch_output"


def test_a_file_that_is_not_a_database_is_moved_aside_and_a_fresh_one_started(tmp_path):
    (tmp_path / DB_NAME).write_bytes(b"this is not a database at all " * 200)
    store = Store(tmp_path)
    try:
        assert "corrupt" in store.note and list(tmp_path.glob(f"{DB_NAME}.corrupt-*"))
        assert store.add_file("batch", "a.jsonl", b"{}", 1)["bytes"] == 2
    finally:
        store.close()


def test_a_damaged_page_is_found_when_the_store_opens(tmp_path):
    store = Store(tmp_path)
    bid = started(store, 400)
    store.close()
    path = tmp_path / DB_NAME
    data = bytearray(path.read_bytes())
    assert len(data) > 8 * 4096
    data[3 * 4096:6 * 4096] = b"\xa5" * (3 * 4096)    # three pages of garbage
    path.write_bytes(bytes(data))
    store = Store(tmp_path)
    try:
        assert "corrupt" in store.note
        assert store.batch(bid) is None          # the damaged store was set aside whole
    finally:
        store.close()


def test_a_full_disk_is_a_storage_full_error_and_the_line_stays_unrecorded(store):
    bid = started(store, 3)
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count={pages}")   # SQLite's SQLITE_FULL, as a full disk
    with pytest.raises(StorageError) as err:
        store.finish_line(bid, 1, True, "x" * 200_000)
    assert err.value.code == "storage_full" and "disk is full" in err.value.message
    assert store.line_states(bid) == {PENDING: 3} and store.batch(bid)["completed"] == 0
    with pytest.raises(StorageError):
        store.add_file("batch", "big.jsonl", b"y" * 500_000, 1)


def test_a_second_process_on_the_same_state_dir_is_refused(tmp_path, store):
    with pytest.raises(StorageError) as err:
        Store(tmp_path)
    assert err.value.code == "storage_busy"


def test_lists_are_newest_first_with_a_cursor(store):
    ids = [store.add_file("batch", f"{i}.jsonl", b"{}", 1)["id"] for i in range(5)]
    page, more = store.files(limit=2)
    assert [f["id"] for f in page] == ids[:2:-1][:2] and more
    page, more = store.files(limit=10, after=page[-1]["id"])
    assert [f["id"] for f in page] == ids[2::-1] and not more
    assert [f["id"] for f in store.files(order="asc", limit=2)[0]] == ids[:2]


def test_a_batch_that_is_no_longer_validating_is_not_started(store):
    f = store.add_file("batch", "in.jsonl", b"x", 1)
    b = store.add_batch(CHAT, f["id"], "24h", 86400, {"k": "v"})
    assert store.set_status(b["id"], "cancelling", only_from=("validating", "in_progress"))
    assert not store.start_batch(b["id"], [(1, "r1", request_line("r1"))], "m")
    assert store.batch(b["id"])["total"] == 0


# ---- shapes ------------------------------------------------------------------------------------
def test_the_input_file_is_checked_line_by_line():
    text = "\n".join([request_line("a"), "not json", request_line("a"),
                      request_line("b", url="/v1/embeddings"),
                      json.dumps({"custom_id": "c", "method": "POST", "url": CHAT}),
                      json.dumps({"custom_id": "d", "method": "GET", "url": CHAT, "body": {}}),
                      "", request_line("e")]) + "\n"
    lines, model, errors = shapes.parse_input(text.encode(), CHAT, 100)
    assert [(n, cid) for n, cid, _ in lines] == [(1, "a"), (8, "e")] and model == "m"
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json"), (3, "duplicate_custom_id"), (4, "mismatched_endpoint"),
        (5, "missing_required_parameter"), (6, "invalid_value")]


def test_an_input_file_over_the_line_limit_or_empty_fails():
    text = "\n".join(request_line(f"r{i}") for i in range(3))
    assert shapes.parse_input(text.encode(), CHAT, 2)[2][0]["code"] == "too_many_lines"
    assert shapes.parse_input(b"\n \n", CHAT, 2)[2][0]["code"] == "empty_file"
    assert shapes.parse_input(b"\xff\xfe", CHAT, 2)[2][0]["code"] == "invalid_file"


def test_output_lines_have_openais_shape():
    line = json.loads(shapes.answered_line("r1", 400, {"error": {"message": "no"}}))
    assert line["custom_id"] == "r1" and line["error"] is None
    assert line["id"].startswith("batch_req_") and line["response"]["status_code"] == 400
    assert line["response"]["body"] == {"error": {"message": "no"}}
    expired = json.loads(shapes.unanswered_line("r2", "batch_expired", "too late"))
    assert expired["response"] is None and expired["error"]["code"] == "batch_expired"


def test_usage_is_read_from_every_routes_answer():
    chat = {"usage": {"prompt_tokens": 9, "completion_tokens": 4,
                      "prompt_tokens_details": {"cached_tokens": 8}}}
    responses = {"usage": {"input_tokens": 7, "output_tokens": 3,
                           "input_tokens_details": {"cached_tokens": 0},
                           "output_tokens_details": {"reasoning_tokens": 1}}}
    assert shapes.usage_of(chat) == (9, 8, 4, 0)
    assert shapes.usage_of(responses) == (7, 0, 3, 1)
    assert shapes.usage_of({"usage": {"prompt_tokens": 5, "total_tokens": 5}}) == (5, 0, 0, 0)
