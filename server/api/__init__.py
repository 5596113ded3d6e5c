"""The routes: one module per API surface (OpenAI chat and completions, Responses, embeddings,
models and tokenization, the native stream, observability, the router's probes). A route parses
its body, asks the service for a generation and shapes the answer with its API's shaping module."""
