"""Routing between replicas of one model: cached prefix against load."""
from dataclasses import dataclass

from server.service.routing import LOAD_TOKENS, pick_replica


@dataclass
class Fake:
    name: str
    cached: int = 0
    outstanding: int = 0

    def cached_prefix(self, tokens):
        return min(self.cached, len(tokens))


PROMPT = list(range(600))


def test_a_long_cached_prefix_keeps_requests_on_the_replica_that_holds_it():
    a, b = Fake("a", cached=560, outstanding=3), Fake("b")
    assert pick_replica([a, b], PROMPT) is a


def test_until_that_replica_is_busier_by_more_than_the_prefix_is_worth():
    busy = 560 // LOAD_TOKENS + 1
    a, b = Fake("a", cached=560, outstanding=busy), Fake("b")
    assert pick_replica([a, b], PROMPT) is b


def test_a_short_shared_head_does_not_outweigh_one_request_of_load():
    # the chat template's first 24 tokens, cached on one replica only
    a, b = Fake("a", cached=24, outstanding=1), Fake("b")
    assert pick_replica([a, b], PROMPT[:94]) is b


def test_equals_go_to_the_less_loaded_then_the_first():
    a, b = Fake("a", outstanding=2), Fake("b", outstanding=1)
    assert pick_replica([a, b], PROMPT) is b
    a, b = Fake("a"), Fake("b")
    assert pick_replica([a, b], PROMPT) is a
