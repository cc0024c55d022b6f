"""Re-export: the persistent batch lives in ``kvferry/model/input_batch.py``, below
both the runner and the speculative drafters that read it."""
from kvferry.model.input_batch import NUM_KNOBS, FlatStep, InputBatch, flatten, to_device  # noqa: F401
