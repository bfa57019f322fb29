"""The only package that touches Thunder.

`step` makes the step program to call (eager, the layered program, or the whole step as one trace)
with the jit options the config implies; `executors` names Thunder's executors and what a trace shows
of them; `layered`, `pieces` and `signature` trace the step piece by piece with layers sharing block
traces; `cache`, `trace_export`, `entries` and `piece_store` are the persistent compile cache; `inplace` keeps the
KV cache writes in place; `trace_speedups` makes cold tracing cheaper.
"""
