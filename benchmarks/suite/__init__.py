"""The benchmark suite's parts; `benchmarks/bench_suite.py` is the program that runs them.

- `workloads`: the states that are saved (synthetic state dicts, GPT-2 with AdamW state);
- `limits`: the machine's own limits (memcpy, O_DIRECT write and read);
- `dcp_async`: DCP `async_save` with its async cached stager, timed (bench_async_staging.py, bench_gpu.py);
- `worker`: one process per candidate (torch.save, DCP, nebulite modes), run by the suite;
- `loader`: one process per cold load, so that nothing of the saving process is reused;
- `resume`: one rank of the resume workload (ranks save their shards, fresh ranks resume them);
- `train`: the training run with a checkpoint every N steps;
- `agents`: stopping the node agents a run started (each run has a runtime directory of its own);
- `monitor`: peak memory (PSS) of a process and its descendants;
- `report`: the table, the targets, the plot.
"""
