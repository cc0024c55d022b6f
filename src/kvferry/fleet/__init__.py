"""Engine cores on a Ray cluster (``kvferry serve --ray ADDRESS``).

    placement.py   the --ray flags: the cluster's address, each role's Ray resources (no ray import)
    core_actor.py  CoreActor: one engine core inside a Ray actor's process (runs on the node)
    ray_cores.py   the front end's side: start the actors, see each as a process, bring a
                   restarted one back, add and end one as a pool scales (imports ray: only with --ray)
    autoscale.py   --autoscale: the measured window and the policy (kvferry plan's model, hysteresis)
    scale_cli.py   kvferry scale: POST /v1/admin/scale from the command line
    node_store.py  with --kv-dram-gb: one node KV store per node that hosts a core, a Ray actor
                   pinned to it, found by the cores through the server's registry (imports ray)

The front end and the router stay in the serve process and reach each actor's
core by tcp:// address, as they reach a joined worker; Ray only places the
cores (by resources) and restarts one whose process dies.
"""
