"""`thunder-batch bench`: the engine against litgpt's own loops and Hugging Face transformers, same prompts, same
weights, one run.

- `cli`: the `bench` command and the run (options, systems, assembly of the result)
- `workloads`: requests (real or random prompts, output lengths, arrival times)
- `system`: what every system gets (BenchContext) and returns (SystemRun)
- `baselines`: litgpt's generate_fn and batched_generate_fn; `engine_runs`: the engine per compile mode;
  `hf_transformers`: transformers' `generate` on static batches (an optional extra)
- `metrics`: per-request traces, latency/throughput, memory, FLOPs and peak rates
- `report`: numbers per run, token checks, speedups and targets, machine info, JSON
- `output`: the tables and the plot
"""
