"""A kernel's cache name covers the headers its source includes from its own
folder (csrc/op_calls.h): an edited header must not load a stale build."""
from __future__ import annotations

from pathlib import Path

from kvferry.model import paged_kernel as pk


def test_an_included_headers_edit_renames_the_build(tmp_path):
    header, inner, source = tmp_path / "shared.h", tmp_path / "inner.h", tmp_path / "op.cpp"
    inner.write_text("inline int one() { return 1; }\n")
    header.write_text('#pragma once\n#include "inner.h"\n#include <vector>\n')
    source.write_text('#include "shared.h"\n  #  include "missing.h"\nint f() { return one(); }\n')
    assert pk.local_headers(source) == [header, inner]  # a name with no file next to it is the compiler's
    name = pk.extension_name("kvferry_t", source, ["-O3"])
    inner.write_text("inline int one() { return 2; }\n")
    edited = pk.extension_name("kvferry_t", source, ["-O3"])
    assert edited != name
    assert pk.extension_name("kvferry_t", source, ["-O3"]) == edited  # stable while nothing changes


def test_the_shipped_kernels_list_their_headers():
    csrc = Path(pk.__file__).parent / "csrc"
    assert pk.local_headers(csrc / "moe_experts.cpp") == [csrc / "op_calls.h"]
    # The decoder layer's TP stack sums over shared memory in C++ (shm_sums.h).
    assert sorted(pk.local_headers(csrc / "decoder_layer.cpp")) == [csrc / "op_calls.h", csrc / "shm_sums.h"]
    assert pk.local_headers(csrc / "paged_decode.cpp") == []  # its cache name is what it was
