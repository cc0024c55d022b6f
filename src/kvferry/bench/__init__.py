"""``kvferry bench``: goodput under SLOs against any OpenAI-compatible server.

    workloads.py / trace.py / corpus.py   what to send (sessions of requests)
    arrivals.py                           when to send it (Poisson, gamma, trace timestamps)
    client.py                             one streaming request -> one RequestRecord
    runner.py                             the bounded asyncio load loop with a progress bar
    metrics.py                            latency percentiles, throughput, goodput (no I/O)
    prom.py                               the server's own Prometheus counters, before/after
    plots.py, compare.py                  PNGs and side-by-side ratios of two result files
    cli.py                                the ``kvferry bench`` argument parser

Nothing here imports torch; matplotlib and rich are imported only when used.
"""
