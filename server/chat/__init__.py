"""What every chat API shares (OpenAI's chat completions and Responses, Anthropic's Messages):
tool calls described in the prompt and read back out of the generated text, and a thinking
model's reasoning told apart from its answer, both as the text streams."""
