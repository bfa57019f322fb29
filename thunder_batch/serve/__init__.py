"""`thunder-batch serve`: the OpenAI-compatible HTTP server.

- `openai`: request parsing into (prompt, SamplingParams) and response shaping (pure Python)
- `routes`: the HTTP side, in LitServe's API server processes (routes, errors, API keys, disconnects)
- `worker`: the inference worker, one Engine per process (admission, steps, cancellation)
- `server`: the main process (assemble the LitServer, run it, stop every child)
- `cli`: the `serve` command
"""
