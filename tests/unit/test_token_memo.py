"""Long prompts tokenized in remembered segments: which special tokens may start a segment, and
the segment bookkeeping (a fake tokenizer; tests/test_token_memo.py checks llama.cpp's)."""
from engine import token_memo
from engine.token_memo import SegmentTokenizer, split_tokens


def test_only_name_like_control_tokens_no_other_token_can_overlap_split():
    specials = [("<start_of_turn>", True, False), ("<end_of_turn>", True, False),
                ("<tab>", True, True),                    # strips its neighbours' whitespace
                ("<user_defined>", False, False),         # not a control token
                ("plain", True, False), ("<a b>", True, False), ("<eos>", True, False)]
    assert split_tokens(specials) == {"<start_of_turn>", "<end_of_turn>", "<a b>", "<eos>"}
    # a token with '<' or '>' inside may overlap (or contain) any <name> no longer than itself
    risky = specials + [("<start_of_turn>user", False, False)]
    assert split_tokens(risky + [("<a_long_control_token_name>", True, False)]) == {
        "<a_long_control_token_name>"}


def tokenizer(**kw):
    calls = []

    def raw(text, bos):
        calls.append((text, bos))
        return ([0] if bos else []) + [ord(c) for c in text]
    return SegmentTokenizer(raw, frozenset({"<t>"}), **kw), calls


def test_a_long_text_is_cut_before_each_split_token_and_long_segments_are_remembered():
    tok, calls = tokenizer()
    head, turn = "h" * token_memo.SEGMENT_CHARS, "<t>" + "x" * token_memo.SEGMENT_CHARS
    text = head + turn * 3 + "<t>short" + "<t>also short"
    assert len(text) >= token_memo.MIN_CHARS
    expected = [0] + [ord(c) for c in text]
    assert tok.tokenize(text, True) == expected
    # the head (with BOS), one call per long turn, the two short ones in one call
    assert calls[0] == (head, True) and calls[-1] == ("<t>short<t>also short", False)
    calls.clear()
    assert tok.tokenize(text + "<t>new", True) == expected + [ord(c) for c in "<t>new"]
    assert calls == [("<t>short<t>also short<t>new", False)]   # the rest came from the memo
    assert tok.tokenize(text, False) == expected[1:]           # without BOS: another key


def test_a_short_text_or_one_without_split_tokens_is_tokenized_whole():
    tok, calls = tokenizer()
    tok.tokenize("<t>" * 10, True)
    text = "y" * token_memo.MIN_CHARS
    tok.tokenize(text, True)
    assert calls == [("<t>" * 10, True), (text, True)]


def test_the_memo_keeps_to_its_token_budget_dropping_the_least_recently_used():
    n = token_memo.MIN_CHARS
    tok, _ = tokenizer(memo_tokens=3 * n)
    texts = ["".join(f"<t>{k}" + "z" * n for k in ks) for ks in ("01", "23", "45")]
    for text in texts:
        tok.tokenize("a" * n + text, False)
    assert tok.held <= tok.memo_tokens and len(tok.memo) == 2
    assert (False, "<t>5" + "z" * n) in tok.memo and (False, "<t>0" + "z" * n) not in tok.memo


def test_many_short_segments_go_in_runs_of_bounded_length():
    tok, calls = tokenizer()
    text = "<t>ab" * 2000
    assert tok.tokenize(text, False) == [ord(c) for c in text]
    assert len(calls) > 10 and all(len(t) < 2 * token_memo.SEGMENT_CHARS for t, _ in calls)
