"""What the benchmarks share: the workload and its workers (``workload``), starting a worker (``worker_process``),
and medians, spreads and JSON results (``figures``); imports no benchmark room."""
