"""OpenAI's request and response shapes: body schemas, the fields we serve or refuse, tool calls,
structured output, and the shaping of chat, completion and Responses answers and streams."""
