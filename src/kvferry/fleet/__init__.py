"""Engine cores on a Ray cluster (``kvferry serve --ray ADDRESS``).

    placement.py   the --ray flags: the cluster's address, each role's Ray resources (no ray import)
    core_actor.py  CoreActor: one engine core inside a Ray actor's process (runs on the node)
    ray_cores.py   the front end's side: start the actors, see each as a process, bring a
                   restarted one back (imports ray: only with --ray)

The front end and the router stay in the serve process and reach each actor's
core by tcp:// address, as they reach a joined worker; Ray only places the
cores (by resources) and restarts one whose process dies.
"""
