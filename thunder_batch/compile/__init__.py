"""The only package that touches Thunder. Its modules (docs/DESIGN.md, Layout, says the same):

- `step`: the step program to call (eager, the layered program, or the whole step as one trace), with
  the jit options the config implies, and its counters and traces.
- `executors`: Thunder's executors by name, which are usable here, and what a trace shows of them.
- `layered`, `traced_piece`, `trace_checks`: the step traced piece by piece (prefix, blocks, heads), layers sharing
  a block trace exactly when Thunder's prologue checks would accept them.
- `cache`, `trace_export`, `cache_listing`, `piece_store`: the persistent compile cache (keys and entry files;
  a trace as Python source and back; listing and clearing a root; the layered program's keys and block
  layouts).
- `provenance`: what made a stored program (the code's bytes, the CPU's machine code generation).
- `load_check`: a stored piece checked against the eager module before its first use.
- `inplace`: the KV cache writes kept in place under Thunder's torch executor.
- `trace_speedups`: cheaper cold tracing, the same traces.
- `project_executor`: the project's executor "thunder_batch" (CPU linears on packed weights).
- `attention`: a decode step's attention, with its KV writes, as one op of that executor.
- `block_op`: a llama-shaped decode block as one native op, and a shape's layers of it as one native loop.
- `fusion`, `fused_region`: the "inductor" fusion executor, and one region compiled, stored, loaded, checked.
- `cuda_graphs`: the composed step of a shape captured in one CUDA graph and replayed.
- `trace_fusions`: what compiled traces fuse, and whether the KV cache write runs inside a region.
"""
