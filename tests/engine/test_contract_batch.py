"""The runner's persistent batch: rows stay dense, moved rows carry all
their state, and columns grow on demand."""
import numpy as np

from kvferry.core.outputs import NewRequestData
from kvferry.model.input_batch import InputBatch
from kvferry.model.sampler import row_knobs
from kvferry.sampling import SamplingParams


def new(rid, n_tokens, blocks, temperature=1.0):
    return NewRequestData(rid, list(range(n_tokens)), SamplingParams(temperature=temperature), [], blocks, 0)


def test_remove_moves_the_last_row_into_the_hole():
    batch = InputBatch(vocab_size=100, max_num_reqs=2, max_num_tokens=4, max_num_blocks=1)
    batch.add(new("a", 3, [0]))
    batch.add(new("b", 5, [1, 2], temperature=0.0))  # grows tokens and blocks
    batch.add(new("c", 2, [3], temperature=0.5))  # grows rows
    batch.append_tokens(batch.index["c"], [42])
    batch.remove("a")
    assert batch.req_ids == ["c", "b"] and batch.index == {"c": 0, "b": 1}
    row = batch.index["c"]
    assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == [0, 1, 42]
    assert batch.block_table[row, : batch.num_blocks[row]].tolist() == [3]
    np.testing.assert_array_equal(batch.sampling_knobs[row], row_knobs(SamplingParams(temperature=0.5), 100))
    b = batch.index["b"]
    assert batch.block_table[b, :2].tolist() == [1, 2] and batch.sampling_knobs[b, 7] == 1.0  # greedy
    batch.remove("b")
    batch.remove("b")  # removing twice is harmless
    assert batch.req_ids == ["c"] and batch.num_reqs == 1


def test_drafts_are_written_but_not_counted():
    batch = InputBatch(vocab_size=100)
    row = batch.add(new("a", 3, [0]))
    batch.write_drafts(row, [7, 8])
    assert batch.num_tokens[row] == 3 and batch.token_ids[row, :5].tolist() == [0, 1, 2, 7, 8]
    batch.append_tokens(row, [7, 9])  # one draft accepted, then the target's token
    assert batch.token_ids[row, : batch.num_tokens[row]].tolist() == [0, 1, 2, 7, 9]
