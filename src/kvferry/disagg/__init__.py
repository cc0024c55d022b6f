"""Prefill/decode disaggregation, engine side.

One request runs its prompt on a prefill core P and its decode on a decode
core D (the router pairs them; see ``kvferry.messages`` for the flow). Here:

* ``transport.py``: how P's KV reaches D's block pool (shared memory written
  in place, or TCP), behind one interface, and D's receiving end;
* ``agent.py``: the per-core transfer agent the runner drives each step: a
  per-step ``StepTransfer`` that the model calls as each layer finishes,
  a sender thread, and the completion / lease / checksum rules.

The scheduler side (no torch) lives in ``core/scheduler.py``: the
``WAITING_FOR_KV`` decode request, the stream orders, the delayed free.
"""
