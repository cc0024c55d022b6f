"""Autoscaling of ``kvferry serve --autoscale PROFILE``: how many cores of
each role to run for the load the server measures.

    server ──finished request──▶ WorkloadWindow ──snapshot──▶ Autoscaler.decide ──Decision──▶ apply (scale)
                                  (rate, lengths over         (kvferry plan's own candidate
                                   the last window_s)          evaluation, bounded, with hysteresis)

- ``window.py``: the measurement window (``WorkloadWindow``, fed on the server's loop);
- ``policy.py``: the decision (``Autoscaler``, ``ScaleBounds``, ``Decision``) through the planner;
- ``flags.py``: the ``--autoscale*`` flags and their defaults (light: ``kvferry serve --help``
  and the argument parser import it without the planner).

No dependency on the engine client or Ray: the server feeds the window on
its event loop and passes ``apply_fn`` (its scale call) to ``Autoscaler.run``.
"""
