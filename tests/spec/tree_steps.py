"""Which path a step with a draft tree takes through the target model: the
one-call C++ decoder layer (layer_op.py) or the Python layer's attention
call, recorded by wrapping the functions llama.py calls (each still runs)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvferry.model import layer_op, llama


@dataclass
class TreeSteps:
    fused_plain: int = 0  # one-call layer runs (a stack or a layer) of steps without a tree
    fused_tree: int = 0  # ... of steps with one
    python_tree: int = 0  # the Python layer's attention calls in steps with a tree

    def check(self) -> None:
        """Where plain steps take the one-call layer, tree steps take it too."""
        if self.fused_plain:
            assert self.fused_tree > 0 and self.python_tree == 0, self


def record_tree_steps(monkeypatch: pytest.MonkeyPatch) -> TreeSteps:
    steps = TreeSteps()

    def fused(run):
        def recording(*args, **kwargs):
            meta = next(a for a in args if hasattr(a, "kernel_tree_masks"))
            if meta.kernel_tree_masks is None:
                steps.fused_plain += 1
            else:
                steps.fused_tree += 1
            return run(*args, **kwargs)
        return recording

    for name in ("run_layers", "run_layer", "run_tp_layer"):
        monkeypatch.setattr(layer_op, name, fused(getattr(layer_op, name)))
    attention = llama.paged_attention

    def python_attention(q, k, v, kv_cache_layer, meta, scale):
        steps.python_tree += bool(meta.tree_masks)
        return attention(q, k, v, kv_cache_layer, meta, scale)

    monkeypatch.setattr(llama, "paged_attention", python_attention)
    return steps
