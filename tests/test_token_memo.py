"""A long prompt tokenized through remembered segments gives llama.cpp's tokens of the whole
text, on both models' vocabularies (SPM: Gemma 3, BPE: SmolLM2), with BOS or without, for the
agents' recorded requests and for texts full of special tokens."""
import json
import random
from pathlib import Path

import pytest

from engine import Model
from tests.server_proc import GEMMA3, SMOLLM2

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "agents").glob("*.json"))
MARKS = ["<start_of_turn>", "<end_of_turn>", "<|im_start|>", "<|im_end|>", "<bos>", "<eos>",
         "<unused7>", "<|endoftext|>", " <start_of_turn>", "<end_of_turn>\n\n", "<start_of_turn"]


@pytest.mark.parametrize("path", [GEMMA3, SMOLLM2], ids=["gemma3", "smollm2"])
def test_segments_give_the_tokens_of_the_whole_text(path):
    model = Model(path)
    try:
        assert model._segmenter().splits   # each vocabulary has tokens to cut at
        rng = random.Random(7)
        texts = []
        for fixture in FIXTURES:
            body = json.loads(fixture.read_text())
            text = json.dumps(body.get("body", body), ensure_ascii=False)
            texts.append(text)
            pieces = text.split(" ")
            texts.append("".join(p + (rng.choice(MARKS) if rng.random() < 0.03 else " ")
                                 for p in pieces))
        for text in texts:
            for bos in (True, False):
                whole = model._tokenize(text, bos, True)
                assert model.tokenize(text, bos) == whole
                assert model.tokenize(text, bos) == whole   # again, from the memo
        assert model._segmenter().hits > 0
    finally:
        model.close()
