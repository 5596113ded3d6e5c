"""Ollama's native API (/api/chat, /api/generate, /api/embed, /api/tags, ...): its request
schemas and option mapping (bodies.py, options.py) and its answer shapes (shape.py). The routes
are server/api/ollama.py, over the same Service as every other API."""
