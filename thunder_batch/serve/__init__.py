"""`thunder-batch serve`: the OpenAI-compatible HTTP server.

- `openai`: a request parsed into a ParsedRequest (prompts, SamplingParams); `responses`: response bodies, stream
  chunks, logprobs, usage (both pure Python)
- `routes`: the HTTP side, in LitServe's API server processes (routes, admission, errors); `in_flight`: one
  request in flight (queued, read, cancelled on disconnect); `auth`: API keys and request ids
- `worker`: the inference worker, one Engine per process; `loop`: its loop (intake, steps, cancellation);
  `token_texts`: token texts for logprobs and echoed prompts
- `shared_state`, `cancels`: what the processes share in shared memory (worker health, requests in flight, cancels)
- `metrics`: Prometheus metrics over every process
- `server`: the main process (assemble the LitServer, run it, drain, stop every child)

The `serve` command itself is thunder_batch/cli/serve.py.
"""
