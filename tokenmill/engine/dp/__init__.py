"""Data parallelism: N engine replicas, each a process of its own with its share of the cores (or its
own GPUs), behind one front end that has the tokenizer and no model.

- replica.py    the replica process: an LLMEngine and the loop that feeds it commands and sends back outputs;
- pool.py       the front end's side of the processes: spawn, pipes, readiness, death, shutdown;
- ray_pool.py   the same for replicas as Ray actors (distributed_executor_backend="ray"), on a Ray cluster;
- routing.py    where a request goes (fewest outstanding, then prefix-cache affinity) and the offline split;
- front_end.py  what both front ends share: the request -> replica book, the replicas' stats;
- engine.py     DataParallelEngine: LLMEngine's offline interface (LLM(data_parallel_size=N), bench);
- async_engine.py AsyncDataParallelEngine: AsyncLLMEngine's interface (`tokenmill serve -dp N`).
"""
