"""``kvferry train-draft``: an EAGLE-style draft head trained by
self-distillation. A tool above the engine: it runs the target through
``kvferry.LLM`` and reads the bench corpora, so it sits outside ``spec/``
(which the runner imports) to keep the packages free of import circles.
The head itself and its data stay in ``spec/`` (``spec/head.py``, ``spec/data/``).
"""
