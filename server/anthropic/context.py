"""Anthropic's context editing: the `context_management` field of a Messages request, parsed
(`parse_edits`) and applied to the request's messages before they become a prompt
(`apply_edits`). The client keeps its full history; only what the model reads this time is
edited, and the answer's `context_management.applied_edits` says what was cleared.

The rules, as Anthropic's context-editing guide and its SDK's types give them:

- `clear_thinking_20251015` drops the thinking (and redacted_thinking) blocks of older assistant
  turns. `keep` is `{"type": "thinking_turns", "value": N}` (N of at least 1: the last N
  assistant turns that hold thinking keep it), `"all"` or `{"type": "all"}` (nothing is cleared:
  what Claude Code sends). Left out, it is 1 turn (the guide's default for the models that do not
  keep every turn; its later default depends on the model, which has no meaning here). A
  tool-use loop is one assistant turn: a user message that carries tool results continues the
  turn, any other user message ends it. An assistant message left with no blocks is dropped.
  Thinking in the history is cleared the same way whether or not the served model thinks.
- `clear_tool_uses_20250919` clears old tool results once the prompt is over `trigger`
  (`{"type": "input_tokens" | "tool_uses", "value": N}`, default 100,000 input tokens; the edit
  runs when the count is above N). It keeps the `keep` most recent tool uses whole
  (`{"type": "tool_uses", "value": N}`, default 3) and clears every older one, oldest first,
  except uses of a tool named in `exclude_tools`. A cleared result's content becomes
  CLEARED_RESULT (Anthropic puts a placeholder there and does not say what it reads) and it is
  no longer marked `is_error`.
  `clear_tool_inputs` (true, or a list of tool names) also empties the `input` of the cleared
  uses (of every one, or of those tools'). `clear_at_least` (`{"type": "input_tokens",
  "value": N}`): if clearing frees fewer than N input tokens, the edit is not applied; an edit
  that would free none is never applied.
- When both are given, `clear_thinking_20251015` must be listed first; each type may be given
  once. Edits run in their order, each measuring the prompt the previous one left. The other
  edit Anthropic knows, `compact_20260112` (a summary written by the model), is refused.
- `applied_edits` lists only the edits that changed the prompt:
  `{"type", "cleared_thinking_turns" | "cleared_tool_uses", "cleared_input_tokens"}`. The
  tokens are the prompt's count before the edit less its count after it, so the sum of them
  plus the final count is the count before any edit (count_tokens' `original_input_tokens`).
  A thinking edit reports at least 0 (a template that drops old thinking itself frees none).

Counting a prompt is costly (it is rendered and tokenized), so it is done at most once before
the first edit that needs it and once per edit that would change something.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.anthropic.messages_body import invalid, unsupported
from server.openai.bodies import INT64_MAX

TOOL_USES = "clear_tool_uses_20250919"
THINKING = "clear_thinking_20251015"
COMPACT = "compact_20260112"
CLEARED_RESULT = "[This tool result was cleared to save context.]"
_THOUGHTS = ("thinking", "redacted_thinking")
_FIELD = "context_management"
_TOOL_USES_KEYS = frozenset({"type", "trigger", "keep", "clear_at_least", "exclude_tools",
                             "clear_tool_inputs"})

Counter = Callable[[list[dict]], int]


@dataclass(frozen=True)
class ClearToolUses:
    trigger: str = "input_tokens"      # what the threshold counts: "input_tokens" or "tool_uses"
    threshold: int = 100_000           # the edit runs when that count is above this
    keep: int = 3                      # the most recent tool uses, left whole
    clear_at_least: int = 0            # input tokens the edit must free, or it is not applied
    exclude_tools: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False   # True: every cleared use's; a set: those tools'


@dataclass(frozen=True)
class ClearThinking:
    keep: int | None = 1               # the last N assistant turns with thinking keep it; None: all


Edit = ClearToolUses | ClearThinking


@dataclass(frozen=True)
class ContextEdits:
    edits: tuple[Edit, ...]


# ---- parsing -----------------------------------------------------------------------------------
def parse_edits(value: Any) -> ContextEdits | None:
    """`context_management` from the request body: None when it is absent, null or asks for no
    edit. Whatever is wrong is a 400 naming its field (`context_management.edits.0.keep.value`)."""
    if value is None:
        return None
    _only(_object(value, _FIELD), frozenset({"edits"}), _FIELD)
    raw = value.get("edits")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise invalid(f"{_FIELD}.edits", "must be a list of edits")
    edits: list[Edit] = []
    for i, item in enumerate(raw):
        edit = _edit(item, f"{_FIELD}.edits.{i}")
        _check_place(edit, edits, f"{_FIELD}.edits.{i}")
        edits.append(edit)
    return ContextEdits(tuple(edits)) if edits else None


def _edit(value: Any, where: str) -> Edit:
    kind = _object(value, where).get("type")
    if kind == TOOL_USES:
        return _tool_uses(value, where)
    if kind == THINKING:
        return _thinking(value, where)
    if kind == COMPACT:
        raise unsupported(f"{where}.type", "no compaction is done here (it needs the model to "
                          "write a summary); use clear_tool_uses_20250919")
    raise invalid(f"{where}.type", f"must be '{THINKING}' or '{TOOL_USES}'")


def _check_place(edit: Edit, before: list[Edit], where: str) -> None:
    if any(type(other) is type(edit) for other in before):
        raise invalid(f"{where}.type", "each type of edit may be given once")
    if isinstance(edit, ClearThinking) and before:
        raise invalid(f"{_FIELD}.edits", f"'{THINKING}' must be listed first when edits are "
                      "combined")


def _tool_uses(obj: dict, where: str) -> ClearToolUses:
    _only(obj, _TOOL_USES_KEYS, where)
    trigger, threshold = _counted(obj, "trigger", where, ("input_tokens", "tool_uses"), 100_000)
    _, keep = _counted(obj, "keep", where, ("tool_uses",), 3)
    _, least = _counted(obj, "clear_at_least", where, ("input_tokens",), 0)
    return ClearToolUses(trigger, threshold, keep, least, _names(obj, "exclude_tools", where),
                         _inputs(obj, where))


def _thinking(obj: dict, where: str) -> ClearThinking:
    _only(obj, frozenset({"type", "keep"}), where)
    keep = obj.get("keep")
    if keep is None:
        return ClearThinking()
    if keep == "all" or (isinstance(keep, dict) and keep.get("type") == "all"):
        if isinstance(keep, dict):
            _only(keep, frozenset({"type"}), f"{where}.keep")
        return ClearThinking(None)
    if not isinstance(keep, dict):
        raise invalid(f"{where}.keep", "must be 'all' or an object "
                      "{\"type\": \"thinking_turns\", \"value\": N}")
    if keep.get("type") != "thinking_turns":
        raise invalid(f"{where}.keep.type", "must be 'thinking_turns' or 'all'")
    return ClearThinking(_counted(obj, "keep", where, ("thinking_turns",), 1, least=1)[1])


def _counted(obj: dict, key: str, where: str, kinds: tuple[str, ...], default: int,
             least: int = 0) -> tuple[str, int]:
    """An object {"type": one of kinds, "value": an integer}; null or absent: the default."""
    value, where = obj.get(key), f"{where}.{key}"
    if value is None:
        return kinds[0], default
    _only(_object(value, where), frozenset({"type", "value"}), where)
    if value.get("type") not in kinds:
        raise invalid(f"{where}.type", "must be " + " or ".join(f"'{k}'" for k in kinds))
    number = value.get("value")
    if isinstance(number, bool) or not isinstance(number, int) or not least <= number <= INT64_MAX:
        raise invalid(f"{where}.value", f"must be an integer of at least {least}")
    return value["type"], number


def _names(obj: dict, key: str, where: str) -> frozenset[str]:
    value = obj.get(key)
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise invalid(f"{where}.{key}", "must be a list of tool names")
    return frozenset(value)


def _inputs(obj: dict, where: str) -> bool | frozenset[str]:
    value = obj.get("clear_tool_inputs")
    if value is None or isinstance(value, bool):
        return bool(value)
    if not isinstance(value, list):
        raise invalid(f"{where}.clear_tool_inputs", "must be true, false or a list of tool names")
    return _names(obj, "clear_tool_inputs", where)


def _object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise invalid(where, "must be an object")
    return value


def _only(obj: dict, allowed: frozenset[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise invalid(f"{where}.{key}", "is not a field of this object")


# ---- applying ----------------------------------------------------------------------------------
@dataclass
class _Prompt:
    """The messages as edited so far, and their token count once it has been needed."""
    messages: list[Any]
    count: Counter
    tokens: int | None = None

    def measured(self) -> int:
        if self.tokens is None:
            self.tokens = self.count(self.messages)
        return self.tokens

    def trial(self, messages: list[Any]) -> tuple[int, int]:
        """(the tokens `messages` would free, their count)."""
        before = self.measured()
        after = self.count(messages)
        return before - after, after

    def adopt(self, messages: list[Any], tokens: int) -> None:
        self.messages, self.tokens = messages, tokens


def apply_edits(edits: ContextEdits, messages: list[dict],
                count_tokens: Counter) -> tuple[list[dict], list[dict]]:
    """The edited messages and the `applied_edits` of the answer. `messages` is not changed;
    the list returned shares the messages and blocks no edit touched. `count_tokens(messages)`
    gives a messages list's prompt token count."""
    prompt = _Prompt(list(messages), count_tokens)
    applied = []
    for edit in edits.edits:
        done = (_clear_thinking(edit, prompt) if isinstance(edit, ClearThinking)
                else _clear_tool_uses(edit, prompt))
        if done is not None:
            applied.append(done)
    return prompt.messages, applied


def _clear_thinking(edit: ClearThinking, prompt: _Prompt) -> dict | None:
    turns = _thinking_turns(prompt.messages)
    if edit.keep is None or len(turns) <= edit.keep:
        return None
    old = turns[:-edit.keep]
    changes: dict[tuple[int, int], dict | None] = {
        (i, j): None for turn in old for i in turn
        for j, block in enumerate(prompt.messages[i]["content"]) if _kind(block) in _THOUGHTS}
    edited = _rewrite(prompt.messages, changes)
    freed, tokens = prompt.trial(edited)
    prompt.adopt(edited, tokens)
    return {"type": THINKING, "cleared_thinking_turns": len(old),
            "cleared_input_tokens": max(freed, 0)}


def _thinking_turns(messages: list[Any]) -> list[list[int]]:
    """The assistant turns that hold thinking, oldest first, each as the indexes of its messages
    that do. A user message without a tool result ends a turn."""
    turns: list[list[int]] = [[]]
    for i, message in enumerate(messages):
        role, blocks = _role(message), _blocks(message)
        if role == "user" and turns[-1] and not any(_kind(b) == "tool_result" for b in blocks):
            turns.append([])
        elif role == "assistant" and any(_kind(b) in _THOUGHTS for b in blocks):
            turns[-1].append(i)
    return [turn for turn in turns if turn]


@dataclass(frozen=True)
class _ToolUse:
    name: str
    call: tuple[int, int]              # (message, block) of the tool_use
    result: tuple[int, int] | None     # of its tool_result, if the history has one


def _clear_tool_uses(edit: ClearToolUses, prompt: _Prompt) -> dict | None:
    uses = _tool_uses_in(prompt.messages)
    size = len(uses) if edit.trigger == "tool_uses" else prompt.measured()
    if size <= edit.threshold:
        return None
    old = [u for u in uses[:max(len(uses) - edit.keep, 0)] if u.name not in edit.exclude_tools]
    changes = _clearing(edit, old, prompt.messages)
    if not changes:
        return None
    edited = _rewrite(prompt.messages, changes)
    freed, tokens = prompt.trial(edited)
    if freed < max(edit.clear_at_least, 1):
        return None
    prompt.adopt(edited, tokens)
    cleared = [u for u in old if u.call in changes or u.result in changes]
    return {"type": TOOL_USES, "cleared_tool_uses": len(cleared), "cleared_input_tokens": freed}


def _clearing(edit: ClearToolUses, uses: list[_ToolUse],
              messages: list[Any]) -> dict[tuple[int, int], dict | None]:
    """The new blocks that clear these tool uses: each result's content, and the input where
    clear_tool_inputs asks for it."""
    changes: dict[tuple[int, int], dict | None] = {}
    for use in uses:
        if use.result is not None:
            i, j = use.result
            result = {k: v for k, v in messages[i]["content"][j].items() if k != "is_error"}
            changes[use.result] = {**result, "content": CLEARED_RESULT}
        if edit.clear_inputs is True or (edit.clear_inputs and use.name in edit.clear_inputs):
            i, j = use.call
            changes[use.call] = {**messages[i]["content"][j], "input": {}}
    return changes


def _tool_uses_in(messages: list[Any]) -> list[_ToolUse]:
    """The history's tool uses in the order they were made, each with its result's place."""
    calls: list[tuple[str, str, tuple[int, int]]] = []
    results: dict[str, tuple[int, int]] = {}
    for i, message in enumerate(messages):
        for j, block in enumerate(_blocks(message)):
            if _kind(block) == "tool_use" and _role(message) == "assistant":
                calls.append((str(block.get("id")), str(block.get("name")), (i, j)))
            elif _kind(block) == "tool_result" and _role(message) == "user":
                results.setdefault(str(block.get("tool_use_id")), (i, j))
    return [_ToolUse(name, at, results.get(call_id)) for call_id, name, at in calls]


def _rewrite(messages: list[Any], changes: dict[tuple[int, int], dict | None]) -> list[Any]:
    """A copy of messages with the blocks at these places replaced (None: removed); a message
    left with no blocks is dropped. Untouched messages are shared, never changed."""
    out = list(messages)
    for i in sorted({i for i, _ in changes}, reverse=True):
        content = [changes.get((i, j), block) for j, block in enumerate(messages[i]["content"])
                   if (i, j) not in changes or changes[(i, j)] is not None]
        if content:
            out[i] = {**messages[i], "content": content}
        else:
            del out[i]
    return out


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _blocks(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, list) else []


def _kind(block: Any) -> Any:
    return block.get("type") if isinstance(block, dict) else None
