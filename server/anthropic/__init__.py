"""Anthropic's Messages API over the same service as the OpenAI routes: its request bodies and
the fields we serve or refuse (schemas.py), its system, messages, tools and thinking as the chat
messages and ToolUse the service takes (convert.py), and its answers, stop reasons, usage and
stream events (format.py)."""
