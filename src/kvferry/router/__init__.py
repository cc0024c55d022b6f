"""The router: one HTTP front end over several engine cores.

    prefix_index.py  which core holds which block hashes (from their block events)
    policy.py        choosing a core: KV-aware prefill cost, power-of-two decode choice
    admission.py     the online step-time model and SLO admission (429 + Retry-After)
    worker.py        one core as the router sees it: address, connection, load, health
    config.py        RouterConfig: mode, data-parallel size, joined addresses, SLOs, CPUs

No torch here: the front end process imports this package.
"""
