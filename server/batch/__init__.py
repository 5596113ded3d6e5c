"""OpenAI's Batch API: uploaded files and batches kept on disk (store.py), their object and line
shapes (shapes.py), and the runner that runs batch lines at background priority (runner.py)."""
