"""The weight load's copies run on the loading thread alone (model/load_threads.py)."""
from __future__ import annotations

import threading

import torch

from kvferry.model.llama import LlamaModel
from kvferry.model.load_threads import copy_weight
from kvferry.model.loader import iter_safetensors, read_config
from tests.tiny_models import make_tiny_checkpoint


class _CopyProbe(torch.Tensor):
    """A checkpoint tensor that records the thread count each copy from it runs with."""

    seen: list[int] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            cls.seen.append(torch.get_num_threads())
        return super().__torch_function__(func, types, args, kwargs or {})


def _on_fresh_thread(fn):
    """Run ``fn`` on a thread of its own, as the engine core loads (its team is the thread's own)."""
    out, errors = [], []

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised below, in the test
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]


def test_every_weight_copy_runs_on_one_thread_and_the_team_comes_back(tmp_path):
    # With a team of two, a parallel copy_ woke the team's worker, which then
    # spun between the load's hundreds of copies: ~1 CPU-s of the 135M load.
    path = make_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=False)
    config = read_config(path)

    def load() -> tuple[list[int], int, LlamaModel]:
        torch.set_num_threads(2)
        model = LlamaModel(config, dtype=torch.float32, device="cpu")
        _CopyProbe.seen = []
        model.load_weights((name, t.as_subclass(_CopyProbe)) for name, t in iter_safetensors(path))
        return list(_CopyProbe.seen), torch.get_num_threads(), model

    seen, threads_after, model = _on_fresh_thread(load)
    assert len(seen) >= 9 * config.num_hidden_layers  # each layer's 7 matrices and 2 norms, and more
    assert set(seen) == {1}
    assert threads_after == 2
    want = dict(iter_safetensors(path))
    torch.testing.assert_close(model.norm.weight, want["model.norm.weight"], rtol=0, atol=0)


def test_copy_weight_copies_converts_and_restores_the_thread_count():
    def run() -> tuple[torch.Tensor, int]:
        torch.set_num_threads(3)
        dst = torch.empty(300, 200, dtype=torch.float32)
        src = torch.randn(300, 200).to(torch.bfloat16)
        copy_weight(dst, src)
        torch.testing.assert_close(dst, src.float(), rtol=0, atol=0)
        return dst, torch.get_num_threads()

    _, threads = _on_fresh_thread(run)
    assert threads == 3
