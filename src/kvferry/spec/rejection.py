"""Re-export: the verification function is the sampler's (``kvferry/model/rejection.py``),
so that ``model/`` never imports ``spec/``."""
from kvferry.model.rejection import NO_DRAFT, accepted_prefix, rejection_sample  # noqa: F401
