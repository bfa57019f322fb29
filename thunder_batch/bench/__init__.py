"""`thunder-batch bench`: the engine against litgpt's own loops, Hugging Face transformers and llama.cpp, same
prompts, same weights, one run. The command itself is thunder_batch/cli/bench.py.

- `options`: the benchmark's options, declared once (BenchOptions)
- `run`: the run (which systems, the workload, assembly of the result); `run_plan`: which (system, precision, B) runs
- `workloads`: requests (real or random prompts, output lengths, arrival times)
- `system_run`: what every system gets (BenchContext) and returns (SystemRun)
- `baselines`: litgpt's generate_fn and batched_generate_fn; `engine_runs`: the engine per compile mode;
  `hf_transformers`: transformers' `generate` on static batches (an optional extra); `llama_cpp`: the user's
  llama-server build
- `parity`: litgpt's generate_fn as the greedy oracle, and the token diff
- `metrics`: per-request traces, latency/throughput, memory, FLOPs and peak rates
- `report`: numbers per run, token checks, speedups and targets, machine info, JSON
- `output`: the tables and the plot
- `prefix`, `prefix_run`: the multi-turn and shared-prefix workloads, prefix reuse off vs on
- `speculative`: --speculative_tokens: decode rate and acceptance per draft length k
"""
