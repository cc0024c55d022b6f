"""A ``.gguf`` over tensor-parallel ranks keeps its blocks: each rank holds
only its slice of them (``-tp 2``: q/k/v and gate/up by output rows, o/down
by input columns, the vocabulary by rows; ``--enable-expert-parallel``:
its whole experts), through the offline LLM API on tiny files: a dense
llama in Q8_0 (its embedding and lm_head too), a Qwen2-MoE in Q8_0 (tied
embedding, shared expert) and, where llama.cpp's ``llama-quantize`` is
found, a llama in Q4_K_M.

Greedy output equals TP 1's; the logprobs are not bit for bit TP 1's. A
row-parallel layer's two halves are summed after the fact, in another
order than one kernel sums a row: on decode-sized batches (the integer
dots, float32 sums) that moves a logprob by ~1e-6, until such a difference
tips one activation's 8-bit rounding in a later layer the other way (the
dots quantize x per block), which moves it by up to ~2e-3 (measured).
Prefill-sized batches multiply bf16 tiles whose products are rounded to
bf16 (quant/kernels.py's ``prefill``), and each rank's partial sum is
rounded apart (as a bf16 float model's over TP): measured up to 0.021 nats
on these models (an Intel Xeon with AMX; without AMX every batch takes
the integer dots). Both within LOGPROB_ATOL; a greedy token may differ only
where TP 1's top two were closer than that (the tiny random models'
distributions are flat: some are).

The Q4_K_M llama differs more, and not by the order of a sum: its o_proj
(256 input columns, one 256-value block per row) is split into half
blocks at TP 2 and served in float there, exact in x, while TP 1's
integer dots round o_proj's input to 8 bits per 256 values (Q8_K, as
llama.cpp does): ~0.7% of o_proj's output (rms, random x), which this
random model carries to 2% (rms) of the residual stream after layer 0 and 3%
after layer 1, and to 0.112 nats on a prefill token, 0.084 on a decode one
(measured on AMD Zen 4). Measured by hand: with o_proj in float at TP 1
too, TP 1 and TP 2 agree to 1.4e-6 on most tokens, but a prompt's
summed halves can tip some of a later layer's 8-bit roundings (as above;
this model amplifies them as it does o_proj's): up to 0.043 nats over
prefixes of the 80-token prompt; with every layer in float
(``--quantization none``), to 7.6e-6 on every token. Hence
Q4_K_M_LOGPROB_ATOL: those roundings together, with some margin.

Memory: a rank holds its share of the file. ``test_a_rank_holds_its_share_of_the_file``
measures rank 1's memory over a 109 MB random MoE file, TP 2 and EP 2.
"""
from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import pytest
import torch

from bench._llama_cpp import missing_reason, quantize
from kvferry import LLM, SamplingParams
from kvferry.model import gguf_convert, gguf_weights
from kvferry.model.config import ModelConfig
from kvferry.model.layers.gguf import GGUFLinearMethod
from kvferry.model.layers.parallel import TPShard
from kvferry.model.moe_quant import GGUFExpertMethod
from kvferry.model.quant import QuantizedWeight
from tests.model.own_cache import own_model_cache
from tests.moe_gguf_writer import MoeShape, write_random_moe_gguf
from tests.tiny_models import make_tiny_checkpoint, write_tiny_gguf
from tests.tiny_moe_models import make_tiny_moe_checkpoint, write_tiny_moe_gguf

MAX_NEW = 8
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_gb=0.02,
              cpu_threads_per_rank=1, warm_up=False)
MODES = {"tp1": {}, "tp2": dict(tensor_parallel_size=2),
         "ep2": dict(tensor_parallel_size=2, enable_expert_parallel=True)}
LOGPROB_ATOL = 0.1  # bf16 rounding of each rank's partial sums on prefill rows: 0.021 measured (0.032 in bf16)
# TP 1's Q8_K rounding of o_proj's input, a float o_proj at TP 2 (the module's docstring): 0.112 measured.
Q4_K_M_LOGPROB_ATOL = 0.25
PARAMS = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(47)
    # 1 token, a short one, and one past the 64-token budget (a chunked prefill): prefill-sized steps.
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (1, 13, 80)]


def _held(model) -> dict:  # noqa: ANN001 - LlamaModel
    """Rank 0's weights of interest (no copies: the model stays referenced)."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    held = {"model": model, "o_proj": attn.o_proj, "qkv": attn.qkv_proj, "embed": model.embed,
            "nbytes": sum(lin.method.nbytes(lin) for lin in model.linears()
                          if isinstance(lin.method, (GGUFLinearMethod, GGUFExpertMethod)))}
    if hasattr(mlp, "w13"):
        held.update(w13=mlp.w13, w2=mlp.w2, experts=(mlp.first_expert, mlp.num_experts))
    else:
        held.update(down=mlp.down_proj)
    return held


def _held_mb(pid: int, file: Path) -> float:
    """What process ``pid`` holds of its own, in MB: its anonymous memory, and
    its proportional share of ``file``'s pages that it maps (PSS: a page that
    both ranks map counts half in each; the kernel may map a large folio of
    the page cache whole, so a rank's RSS can count the other rank's rows of
    an expert that it never reads). Libraries, shared with every torch
    process on the host, are left out: their share moves with the host's load."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    held = int(status["RssAnon"].split()[0]) / 1024
    in_file = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's first line: addresses, perms, offset, dev, inode[, path]
            in_file = len(head) >= 6 and head[-1] == str(file)
        elif head[0] == "Pss:" and in_file:
            held += int(head[1]) / 1024
    return held


def _run(path: Path, mode: str, dtype: str = "float32") -> dict:
    llm = LLM(model=str(path), **MODES[mode], **{**ENGINE, "dtype": dtype})
    try:
        model = llm.engine.core.runner.model
        prompts = _prompts(model.config.vocab_size)
        prefill = [r.outputs[0] for r in llm.generate(prompts, PARAMS)]
        # Every step at most 3 rows: the integer dots alone.
        decode = [r.outputs[0] for r in llm.generate([p[:1] for p in prompts], PARAMS)]
        tp = llm.engine.core.tp
        held_mb = _held_mb(tp._procs[0].pid, path) if tp is not None else None  # rank 1's
        llm.engine.check_integrity()
        return {"prefill": prefill, "decode": decode, "rank1_mb": held_mb, **_held(model)}
    finally:
        llm.engine.core.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    with own_model_cache(tmp_path_factory.mktemp("gguf-tp")) as tmp:
        # vocab 385: rank 1's slice is one row short, padded with a zero block row.
        out = {"llama": write_tiny_gguf(make_tiny_checkpoint(tmp / "dense", "llama", vocab_size=385),
                                        tmp / "llama-q8.gguf", qtype="Q8_0", quantize_vocab=True),
               "qwen2_moe": write_tiny_moe_gguf(make_tiny_moe_checkpoint(tmp, "qwen2_moe_top2"),
                                                tmp / "qwen2-moe-q8.gguf", "Q8_0")}
        if missing_reason("llama-quantize") is None:
            # hidden 256: K-quant rows; o_proj's 256 input columns split into 128 per rank (half a block).
            hf = make_tiny_checkpoint(tmp / "kq", "llama", hidden_size=256, intermediate_size=512,
                                      num_attention_heads=4, num_key_value_heads=2)
            out["q4_k_m"] = quantize(write_tiny_gguf(hf, tmp / "kq-f32.gguf"), tmp / "kq-q4_k_m.gguf", "Q4_K_M")
        yield tmp, out


@pytest.fixture(scope="module")
def runs(files):
    """model -> mode -> what _run returns, every engine started once."""
    _, paths = files
    modes = {"llama": ("tp1", "tp2"), "qwen2_moe": ("tp1", "tp2", "ep2"), "q4_k_m": ("tp1", "tp2")}
    # The MoE in bf16 (the default dtype where the CPU has AMX): at TP 2 its experts' down is in
    # float (not whole blocks per rank) after gate_up's blocks, whose products are float32.
    dtype = {"qwen2_moe": "bfloat16"}
    return {name: {mode: _run(path, mode, dtype.get(name, "float32")) for mode in modes[name]}
            for name, path in paths.items()}


def _model_runs(runs: dict, model: str) -> dict:
    if model not in runs:
        pytest.skip(missing_reason("llama-quantize") or f"{model} was not made")
    return runs[model]


def _assert_agrees(base: list, other: list, what: str, atol: float) -> None:
    compared = 0
    for i, (a, b) in enumerate(zip(base, other, strict=True)):
        for j, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            lp_a, lp_b = a.logprobs[j], b.logprobs[j]
            if ta != tb:
                gap = lp_a.top_logprobs[0] - lp_a.top_logprobs[1]
                assert gap < atol, f"{what}, prompt {i}: token {j} is {tb}, TP 1's {ta} led by {gap:.3f} nats"
                break
            assert abs(lp_a.logprob - lp_b.logprob) < atol, (what, i, j, lp_a.logprob, lp_b.logprob)
            compared += 1
    # A flip is legitimate only at a near tie (asserted above), and then ends the comparison of that
    # prompt: the tiny random models' distributions are flat, so some prompts flip early.
    assert compared >= 2 * len(base), f"{what}: only {compared} tokens agree"


@pytest.mark.parametrize("model, mode", [("llama", "tp2"), ("qwen2_moe", "tp2"), ("qwen2_moe", "ep2"),
                                         ("q4_k_m", "tp2")])
def test_greedy_equals_tp1(runs, model, mode):
    r = _model_runs(runs, model)
    atol = Q4_K_M_LOGPROB_ATOL if model == "q4_k_m" else LOGPROB_ATOL
    _assert_agrees(r["tp1"]["prefill"], r[mode]["prefill"], f"{model} {mode}", atol)
    _assert_agrees(r["tp1"]["decode"], r[mode]["decode"], f"{model} {mode} decode", atol)


def test_each_rank_holds_its_slice_of_the_blocks(runs):
    """Rank 0 of TP 2 holds TP 1's blocks sliced: q, k and v's rows of its
    heads, o_proj's first half of each row's blocks, the vocabulary's first
    half (zero rows after it where it is short); half the bytes in all."""
    tp1, tp2 = runs["llama"]["tp1"], runs["llama"]["tp2"]
    cfg: ModelConfig = tp1["model"].config
    for lin in (tp2["o_proj"], tp2["qkv"], tp2["down"]):
        assert isinstance(lin.method, GGUFLinearMethod) and len(lin.qweights) == 1
    o1, o2 = tp1["o_proj"].qweights[0], tp2["o_proj"].qweights[0]
    assert o2.shape == (o1.out_features, o1.in_features // 2)
    assert torch.equal(o2.data, o1.data[:, :o1.data.shape[1] // 2])
    q, kv = cfg.q_size, cfg.kv_size
    qkv1 = tp1["qkv"].qweights[0].data
    want = torch.cat([qkv1[:q // 2], qkv1[q:q + kv // 2], qkv1[q + kv:q + kv + kv // 2]])
    assert torch.equal(tp2["qkv"].qweights[0].data, want)
    e1, e2 = tp1["embed"].qweight, tp2["embed"].qweight
    half = -(-cfg.vocab_size // 2)
    assert isinstance(e2, QuantizedWeight) and e2.out_features == half
    assert torch.equal(e2.data, e1.data[:half])
    assert tp2["model"].lm_head is None and tp2["model"].logits_proj.qweights[0].out_features == half
    assert 0.45 < tp2["nbytes"] / tp1["nbytes"] < 0.55


def test_experts_over_ranks(runs):
    """EP 2: rank 0's experts 0..3 whole, TP 1's bytes, held as at TP 1
    (gguf_memory.py: huge pages, or views of the mapped file). TP 2: every expert's gate/up rows halved in blocks; the
    experts' down (16 of 32 input columns per rank, half a Q8_0 block) in
    float, as the log line says."""
    tp1, tp2, ep2 = (runs["qwen2_moe"][m] for m in ("tp1", "tp2", "ep2"))
    assert (ep2["experts"], tp2["experts"]) == ((0, 4), (0, 8))
    for e in range(4):
        for stack in ("w13", "w2"):
            got, want = ep2[stack].expert_weights[e], tp1[stack].expert_weights[e]
            assert all(torch.equal(g.data, w.data) for g, w in zip(got, want, strict=True))
            # In a larger mapping (the rank's huge-page arena, or the file): no copy per expert.
            assert all(g.data.untyped_storage().nbytes() > g.nbytes for g in got)
    assert isinstance(tp2["w13"].method, GGUFExpertMethod) and not isinstance(tp2["w2"].method, GGUFExpertMethod)
    gate1, gate2 = tp1["w13"].expert_weights[5][0], tp2["w13"].expert_weights[5][0]
    assert torch.equal(gate2.data, gate1.data[:gate1.out_features // 2])


def test_k_quant_columns_that_are_not_whole_blocks_are_served_in_float(runs, files, caplog):
    r = _model_runs(runs, "q4_k_m")["tp2"]
    assert not isinstance(r["o_proj"].method, GGUFLinearMethod)  # 128 of 256 columns: half a Q4_K block
    assert isinstance(r["down"].method, GGUFLinearMethod) and r["down"].in_features == 256  # 512 -> 256: whole
    assert isinstance(r["qkv"].method, GGUFLinearMethod)
    path = files[1]["q4_k_m"]
    reader = gguf_weights.open_gguf(path)
    kept = gguf_weights.quantized_layers(reader, path.name)
    hf = json.loads((gguf_convert.convert_gguf(path, weights=False) / "config.json").read_text())
    with caplog.at_level(logging.INFO, logger="kvferry.model.gguf_weights"):
        split = gguf_weights.split_layers(reader, hf, r["model"].config, TPShard(0, 2), kept, False, path.name)
    assert kept - split == {"model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}
    lines = [rec.message for rec in caplog.records if "served in float" in rec.message]
    assert len(lines) == 1 and "'blk.0.attn_output.weight' (Q4_K): a rank's 128 of its 256 input columns" in lines[0]


def test_quantization_gguf_refuses_a_split_that_is_not_whole_blocks(files):
    path = files[1].get("q4_k_m")
    if path is None:
        pytest.skip(missing_reason("llama-quantize") or "no K-quant file")
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2: GGUF tensor 'blk\.0\.attn_output\.weight' "
                                         r"\(Q4_K\): a rank's 128 of its 256 input columns are not whole "
                                         r"256-value blocks \(leave --quantization out") as e:
        LLM(model=str(path), tensor_parallel_size=2, quantization="gguf", **ENGINE)
    assert "\n" not in str(e.value)
    deadline = time.monotonic() + 30
    while _rank_children() and time.monotonic() < deadline:  # the other rank is ended, not leaked
        time.sleep(0.2)
    assert not _rank_children()


def _rank_children() -> list[str]:
    """Command lines of this process's children that are tensor-parallel ranks."""
    found = []
    for task in Path("/proc/self/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_text()
            except OSError:
                continue
            if "rank" in cmd or "tp_worker" in cmd:
                found.append(cmd)
    return found


def test_a_rank_holds_its_share_of_the_file(files, runs):
    """Rank 1's memory (``_held_mb``) over a 110 MB random Qwen3-MoE file in
    Q8_0, after a request, less the same rank's over the tiny MoE file: at
    most about half the file, TP 2 (the experts' down split in whole
    blocks: 1024 -> 512 columns) and EP 2 alike (measured 0.51 and 0.50 of
    it, bf16, with the rank's slices read into huge pages, the default where
    the kernel has them; 0.39 and 0.31 under KVFERRY_GGUF_WEIGHTS=mapped,
    where experts that no token was routed to are not resident).
    Expanded to float, as before, each rank held 2x the file; a rank that
    read the whole file would hold 1x."""
    tmp, _ = files
    shape = MoeShape(layers=2, experts=16, top_k=2, hidden=1024, moe_inter=1024)
    path = write_random_moe_gguf(tmp / "big-moe-q8.gguf", shape, "Q8_0")
    file_mb = path.stat().st_size / 2**20
    base = runs["qwen2_moe"]["tp2"]["rank1_mb"]
    for mode in ("tp2", "ep2"):
        llm = LLM(model=str(path), **MODES[mode], **{**ENGINE, "dtype": "bfloat16"})  # as the baseline's
        try:
            llm.generate([list(range(3, 40)), [5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            held = _held_mb(llm.engine.core.tp._procs[0].pid, path)
        finally:
            llm.engine.core.close()
        print(f"\n{mode}: file {file_mb:.0f} MB, rank 1 holds {held:.0f} MB, over the tiny file {base:.0f} MB")
        # Half the file at most, and the float routers and norms.
        assert held - base < 0.6 * file_mb, (mode, held, base, file_mb)
