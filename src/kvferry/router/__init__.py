"""The router: one HTTP front end over several engine cores.

    prefix_index.py  which core holds which block hashes (from their block events)
    policy.py        choosing a core: KV-aware prefill cost, power-of-two decode choice
    routing.py       Router: feeds the policy from the membership, index and load
    admission.py     the online step-time model and SLO admission (429 + Retry-After)
    worker.py        one core as the router sees it: address, connection, load, health
    membership.py    the workers by name, joining, /health, the hello-based health monitor
    listener.py      reading every worker's outputs; noticing a started core's exit
    supervisor.py    starting the owned cores, restarting dead ones within a budget
    pairing.py       disagg: one stream from a sequence on a decode and a prefill core
    errors.py        EngineDeadError and kin (re-exported by serve/engine_client.py)
    stats.py         one SchedulerStats from several cores
    config.py        RouterConfig: mode, data-parallel size, joined addresses, SLOs, CPUs

No torch here: the front end process imports this package.
"""
