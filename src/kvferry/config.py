"""One dataclass per component, validated in __post_init__ (ValueError names the field).

``EngineArgs`` is the one list of engine options: it generates the CLI flags
(names and defaults after vLLM's), feeds ``LLM`` / ``LLMEngine`` and the
engine core process, and builds the per-component configs below.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from kvferry.afd_config import AFDConfig, check_afd
from kvferry.spec_config import (EMBEDDED_DRAFT_HEAD, SPEC_METHODS, SPECULATIVE_DEFAULT, SPECULATIVE_OFF,  # noqa: F401
                                  SpeculativeConfig)
# The address module alone (standard library), not the tier: the config
# checks a --kv-cluster URL without loading the pool.
from kvferry.kvstore.pool_address import PoolAddress, check_auto, is_auto

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype (kvferry.model.kv_cache_dtype): "auto" is the model's dtype.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # Number of KV blocks in the device pool. None: size it from kv_cache_memory_gb.
    num_kv_blocks: int | None = None
    # GiB for the pool. None: a share of the memory free at start (engine/kv_memory.py).
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    # Host-DRAM blocks for swapping out preempted requests (0: always recompute).
    num_swap_blocks: int = 0
    # K/V storage: "auto" (the model's dtype, exact), "fp8_e4m3" ("fp8") or
    # "fp8_e5m2": half the bytes, lossy (kvferry.model.kv_cache_dtype).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not _is_int(self.block_size) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (not _is_int(self.num_kv_blocks) or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if not _is_int(self.num_swap_blocks) or self.num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be an integer >= 0, got {self.num_swap_blocks!r}")
        if self.kv_cache_memory_gb is not None and (
                not isinstance(self.kv_cache_memory_gb, (int, float)) or not 0 < self.kv_cache_memory_gb < math.inf):
            raise ValueError(f"kv_cache_memory_gb must be a finite number > 0, got {self.kv_cache_memory_gb!r}")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # What the user asked for; 0: no limit of its own. The engine core
    # resolves the context length actually served (EngineCore.max_model_len):
    # this, else the model's, and never more than the KV pool can hold.
    max_model_len: int = 0
    enable_chunked_prefill: bool = True
    # What preemption does with a victim's KV: "swap" keeps it (host swap
    # space, else the KV store's DRAM), "recompute" drops it. None: swap
    # when a swap space (num_swap_blocks > 0) or a KV store is configured.
    preemption_mode: str | None = None

    def __post_init__(self) -> None:
        if self.preemption_mode not in (None, "swap", "recompute"):
            raise ValueError(f"preemption_mode must be 'swap' or 'recompute', got {self.preemption_mode!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not _is_int(self.max_model_len) or self.max_model_len < 0:
            raise ValueError(f"max_model_len must be an integer >= 0, got {self.max_model_len!r}")


ATTENTION_BACKENDS = ("auto", "torch", "triton")
# --quantization (vLLM's flag): a .gguf's blocks served as they are, or expanded to float;
# int8 (W8A8) quantized at load, or a compressed-tensors int8 checkpoint as it is.
QUANTIZATIONS = ("gguf", "int8", "compressed-tensors", "none")


@dataclass(slots=True)
class ModelLoadConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded default
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "auto"  # auto | torch | triton (model/attention.py)
    enforce_eager: bool = False  # CUDA: no decode graphs
    warm_up: bool = True  # one full-size dummy step before the core reports ready
    # Batch-invariant kernels: greedy output independent of batch, chunking,
    # prefix hits and P/D (model/layers/unquantized.py, csrc/paged_decode.cpp)
    deterministic: bool = False
    # None: the file's own (a .gguf's blocks stay quantized where they run); "none": expand (model/loader.py)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; supported: {', '.join(QUANTIZATIONS)}")
        for name in ("deterministic", "warm_up", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.deterministic and self.device != "cpu":
            raise ValueError(f"deterministic runs on the CPU kernels only, got device {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")


_KV_TRANSPORTS = ("shm", "tcp")
_KV_FAILURE = ("recompute", "fail")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*", "")


def kv_transfer_host(address: str) -> str:
    """The host of a ``tcp://HOST:PORT`` transfer address ('' for ipc://)."""
    return address[len("tcp://"):].rpartition(":")[0] if address.startswith("tcp://") else ""


def is_wildcard_address(address: str) -> bool:
    """tcp://0.0.0.0:P, tcp://[::]:P, tcp://*:P: every interface of the host."""
    return address.startswith("tcp://") and kv_transfer_host(address) in _WILDCARD_HOSTS


@dataclass(slots=True)
class KVTransferConfig:
    """Prefill/decode disaggregation on one engine core (kvferry.disagg)."""

    # The core's transfer socket (tcp://host:port; port 0 picks a free one).
    # "": the core takes no part in disaggregation.
    kv_transfer_address: str = ""
    # How this core sends KV: "shm" writes straight into a decode core's
    # pool on the same host (falling back to tcp when it cannot attach it).
    kv_transport: str = "shm"
    # A decode core whose KV does not arrive intact: recompute the prompt
    # itself, or finish the request with an error.
    kv_transfer_failure: str = "recompute"
    # Lease of a transfer: a decode core waits this long for the KV; a
    # prefill core holds its blocks this long for the acknowledgement.
    kv_transfer_timeout_s: float = 30.0
    # Listen on every interface (the address's host is then only what peers
    # are told to connect to; a wildcard host tells them this host's name).
    # Off: the socket binds to the address's own interface, and a wildcard
    # address is refused, so a transfer port is never opened to every
    # network by accident (its peers must still present the token).
    kv_transfer_bind_any: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.kv_transfer_address, str) or (
                self.kv_transfer_address and not self.kv_transfer_address.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"kv_transfer_address must be tcp://host:port or ipc://path, "
                             f"got {self.kv_transfer_address!r}")
        if self.kv_transfer_address.startswith("tcp://"):
            port = self.kv_transfer_address.rpartition(":")[2]
            if ":" not in self.kv_transfer_address[len("tcp://"):] or not (port.isdigit() or port == "*"):
                raise ValueError(f"kv_transfer_address must be tcp://host:port, got {self.kv_transfer_address!r}")
        if is_wildcard_address(self.kv_transfer_address) and not self.kv_transfer_bind_any:
            raise ValueError(f"kv_transfer_address {self.kv_transfer_address!r} listens on every interface: "
                             "give this node's own address (e.g. tcp://10.0.0.5:5600 or tcp://127.0.0.1:0), "
                             "or pass --kv-transfer-bind-any to open it on all of them on purpose")
        if not isinstance(self.kv_transfer_bind_any, bool):
            raise ValueError(f"kv_transfer_bind_any must be a bool, got {self.kv_transfer_bind_any!r}")
        if self.kv_transport not in _KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {', '.join(_KV_TRANSPORTS)}; got {self.kv_transport!r}")
        if self.kv_transfer_failure not in _KV_FAILURE:
            raise ValueError(f"kv_transfer_failure must be one of {', '.join(_KV_FAILURE)}; "
                             f"got {self.kv_transfer_failure!r}")
        if not isinstance(self.kv_transfer_timeout_s, (int, float)) or not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s!r}")


# DRAM of the node store started for --kv-cluster without --kv-dram-gb, GiB.
DEFAULT_CLUSTER_DRAM_GB = 1.0


@dataclass(slots=True)
class KVTierConfig:
    """The node's KV store below the device pool (``kvferry.kvstore``).

    The fields are named as the ``--kv-*`` flags of ``kvferry serve`` and
    ``kvferry kvstore`` (one name per option everywhere). ``kv_store``
    attaches to a running store; otherwise ``kv_dram_gb`` > 0 makes the
    launcher start one (``kvstore.launch.start_store``, with the optional
    disk, cluster and remote tiers) and fill in its address. Neither:
    device-only caching. ``kv_cluster`` alone starts a store too, with
    ``DEFAULT_CLUSTER_DRAM_GB`` of DRAM."""

    kv_store: str = ""
    kv_dram_gb: float = 0.0
    kv_disk: str = ""
    kv_disk_gb: float = 0.0
    kv_remote: str = ""
    # The cluster KV pool, mooncake://MASTER_HOST:PORT?metadata=URL
    # (kvferry.kvstore.cluster): a tier of the store this config starts.
    kv_cluster: str = ""
    # Most tokens one request may load from the store (0: no cap), so that
    # one long conversation cannot monopolize the store's I/O.
    max_load_tokens: int = 0
    # Run kv_remote / kv_cluster without the cluster secret (unkeyed
    # checksums, private blocks unsealed; shared_tier.py): refused otherwise.
    insecure_shared_tier: bool = False

    def __post_init__(self) -> None:
        for name in ("kv_dram_gb", "kv_disk_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not _is_int(self.max_load_tokens) or self.max_load_tokens < 0:
            raise ValueError(f"max_load_tokens must be an integer >= 0, got {self.max_load_tokens!r}")
        if self.kv_disk and not self.kv_disk_gb:
            raise ValueError("kv_disk_gb must be > 0 when kv_disk is set")
        if not isinstance(self.insecure_shared_tier, bool):
            raise ValueError(f"insecure_shared_tier must be a bool, got {self.insecure_shared_tier!r}")
        for name in ("kv_store", "kv_disk", "kv_remote", "kv_cluster"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.kv_store and not self.kv_store.startswith(("ipc://", "tcp://")):
            raise ValueError(f"kv_store must be a store's address, ipc://PATH or tcp://HOST:PORT, got {self.kv_store!r}")
        if self.kv_remote and not self.kv_remote.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_remote must be a redis:// URL, got {self.kv_remote!r}")
        if self.kv_cluster:
            # auto: kvferry serve --ray starts a master and puts its URL here
            # before any store starts (a store given "auto" refuses it).
            check_auto(self.kv_cluster) if is_auto(self.kv_cluster) else PoolAddress.parse(self.kv_cluster)
            if not self.kv_store and not self.kv_dram_gb:
                self.kv_dram_gb = DEFAULT_CLUSTER_DRAM_GB  # the pool lies below a node store's DRAM

    @property
    def enabled(self) -> bool:
        return bool(self.kv_store or self.kv_dram_gb)


TP_ALL_REDUCES = ("shm", "gloo")


@dataclass(slots=True)
class ParallelConfig:
    """Tensor parallelism: one engine core as ``tensor_parallel_size`` rank
    processes on this host (kvferry.engine.tp_ranks, docs/parallelism.md);
    pipeline parallelism: as ``pipeline_parallel_size`` stage processes
    (kvferry.engine.pp_stages)."""

    tensor_parallel_size: int = 1
    # torch threads of each rank (None: this host's CPUs / tensor_parallel_size).
    cpu_threads_per_rank: int | None = None
    # How the ranks sum their partial products: "shm" (shared memory, one
    # host; parallel/shm_all_reduce.py) or "gloo" (torch's, over loopback TCP).
    tp_all_reduce: str = "shm"
    # Pipeline parallelism: the layers over this many stage processes
    # (kvferry.engine.pp_stages), and the micro-batches a step is cut into
    # so that the stages overlap (None: up to one per stage, by the step's size).
    pipeline_parallel_size: int = 1
    pp_micro_batches: int | None = None
    # A mixture of experts' experts whole per rank (vLLM's --enable-expert-parallel),
    # else each expert sliced over the ranks (model/layers/parallel.py).
    enable_expert_parallel: bool = False
    afd: AFDConfig = field(default_factory=AFDConfig)  # --ffn M: the MLPs in FFN worker processes

    def __post_init__(self) -> None:
        if not _is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.cpu_threads_per_rank is not None and (not _is_int(self.cpu_threads_per_rank) or self.cpu_threads_per_rank < 1):
            raise ValueError(f"cpu_threads_per_rank must be an integer >= 1, got {self.cpu_threads_per_rank!r}")
        if self.tp_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(f"tp_all_reduce must be one of {', '.join(TP_ALL_REDUCES)}, got {self.tp_all_reduce!r}")
        if not _is_int(self.pipeline_parallel_size) or self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size must be an integer >= 1, got {self.pipeline_parallel_size!r}")
        if self.pp_micro_batches is not None and (not _is_int(self.pp_micro_batches) or self.pp_micro_batches < 1):
            raise ValueError(f"pp_micro_batches must be an integer >= 1, got {self.pp_micro_batches!r}")


# The longest chunk the C++ attention kernel takes (model.attention.kernel_max_chunk_tokens;
# this module stays torch-free): --deterministic's bound on a step's tokens.
DETERMINISTIC_MAX_BATCHED_TOKENS = 8192


@dataclass(slots=True)
class EngineConfig:
    model: ModelLoadConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    speculative: SpeculativeConfig | None = None
    kv_tiers: KVTierConfig = field(default_factory=KVTierConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    # A KV connector from outside the package, "module:Class" ("": none;
    # kvferry.engine.kv_connector.connectors.load_connector).
    kv_connector: str = ""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.parallel.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.parallel.pipeline_parallel_size > 1:
            self._check_pipeline_parallel()
        check_afd(self)  # --ffn: what attention/FFN disaggregation does not run with yet
        if self.model.deterministic and self.scheduler.max_num_batched_tokens > DETERMINISTIC_MAX_BATCHED_TOKENS:
            raise ValueError(f"deterministic needs max_num_batched_tokens <= {DETERMINISTIC_MAX_BATCHED_TOKENS} "
                             f"(longer chunks leave the batch-invariant attention kernel), got "
                             f"{self.scheduler.max_num_batched_tokens}")
        if self.kv_connector and (not isinstance(self.kv_connector, str) or self.kv_connector.count(":") != 1
                                  or not all(self.kv_connector.split(":"))):
            raise ValueError(f"kv_connector must be 'module:Class', got {self.kv_connector!r}")

    def _refused_over_ranks(self, where: str, methods: tuple = (*SPEC_METHODS, "auto+head")) -> list[tuple[bool, str]]:
        """What runs on neither tensor-parallel ranks nor pipeline stages yet (speculation: ``methods`` run)."""
        spec = self.speculative  # "auto+head": auto with a draft head among its choices
        method = spec and spec.method + ("+head" if spec.method == "auto" and spec.model is not None else "")
        return [
            (self.model.device != "cpu", f"device {self.model.device!r} (the {where} run on the CPU)"),
            (self.model.deterministic, "deterministic"),
            (spec is not None and method not in methods,  # named as the flag that chose it
             f"speculative method {method!r} ({', '.join(methods)} work) from --speculative-config"),
        ]

    def _check_tensor_parallel(self) -> None:
        """What does not run over tensor-parallel ranks yet: a one-line ValueError."""
        tp = self.parallel.tensor_parallel_size
        for what in (what for bad, what in self._refused_over_ranks("ranks' collectives") if bad):
            raise ValueError(f"tensor_parallel_size {tp} does not work with {what} yet")

    def _check_pipeline_parallel(self) -> None:
        """What does not run over pipeline stages yet: a one-line ValueError."""
        for what in (what for bad, what in self._refused_over_ranks("stages") if bad):
            raise ValueError(f"pipeline_parallel_size {self.parallel.pipeline_parallel_size} does not work "
                             f"with {what} yet")


def default_speculation(config: EngineConfig) -> tuple[SpeculativeConfig | None, str]:
    """What ``--speculative-config default`` (the commands' default) runs
    with the rest of ``config``, and one line saying so (logged once at
    start): method auto under the cost-aware controller, or off where
    speculation cannot run. An explicit config keeps its errors instead."""
    for bad, what in [(config.model.deterministic, "--deterministic (its batch-invariant steps are measured "
                                                   "without drafts)")]:
        if bad:
            return None, f"speculative decoding: off by default with {what}; give --speculative-config to choose one"
    # The embedded model's committed draft head joins auto's choices (chat, where suffix and n-gram
    # rarely match); not over GGUF blocks (it reads the float embedding and lm_head) nor pipeline stages
    # (there the last stage drafts ahead for every request, whatever auto chooses: unmeasured as a default).
    head = (EMBEDDED_DRAFT_HEAD if config.model.model is None and config.model.quantization != "gguf"
            and config.parallel.pipeline_parallel_size == 1 and EMBEDDED_DRAFT_HEAD.is_file() else None)
    # Suffix decoding and the head draft trees on the CPU, where a tree step runs fused at a path step's cost
    # (docs/speculative.md, "draft trees"); on CUDA a tree step runs eagerly and re-attends in torch: paths.
    tree = config.model.device == "cpu"
    spec = SpeculativeConfig(method="auto", model=None if head is None else str(head), draft_tree=tree)
    choices = "suffix, n-gram or the draft head" if head is not None else "suffix or n-gram"
    return spec, (f"speculative decoding: auto ({choices}, {'trees' if tree else 'paths'} of k <= "
                  f"{spec.num_speculative_tokens}) where the cost-aware controller measures a gain, plain decoding "
                  "elsewhere (the default; --speculative-config off turns it off)")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _opt(help: str, **cli: Any) -> Any:
    """Field metadata: the flag's help text and extra argparse options."""
    return {"help": help, **cli}


@dataclass(slots=True)
class EngineArgs:
    """Every engine option, once. ``--flag-name`` is the field name with dashes."""

    model: str | None = field(default=None, metadata=_opt(
        "a folder (config.json, tokenizer, safetensors), a .gguf file or a Hugging Face id org/name in the "
        "local cache (default: the embedded SmolLM2-135M-Instruct)"))
    dtype: str = field(default="auto", metadata=_opt("weights and activations dtype", choices=_DTYPES))
    device: str = field(default="cpu", metadata=_opt("cpu or cuda[:N]"))
    attention_backend: str = field(default="auto", metadata=_opt(
        "attention kernels: torch (torch ops and, on CPU, the C++ kernel), triton (Triton kernels; on CPU only "
        "in Triton's interpreter), auto (triton on CUDA, torch on CPU)", choices=ATTENTION_BACKENDS))
    enforce_eager: bool = field(default=False, metadata=_opt(
        "CUDA: run every step eagerly (no CUDA graphs for decode batches)"))
    warm_up: bool = field(default=True, metadata=_opt(
        "run one full-size dummy prefill step and a decode step before reporting ready, so that the first "
        "requests do not pay for the first forward pass's one-time costs"))
    deterministic: bool = field(default=False, metadata=_opt(
        "batch-invariant kernels (CPU): greedy output does not depend on the batch, chunking, prefix-cache "
        "hits or P/D (as SGLang's --enable-deterministic-inference); slower, see docs/serving.md"))
    quantization: str | None = field(default=None, metadata=_opt(
        "weight format. Left out: the model's own; a .gguf file's linear weights stay in their quantized blocks, "
        "multiplied by integer kernels (types without a kernel, such as IQ*, dequantized at load), and are expanded "
        "to float where the blocks do not run (CUDA, --deterministic) and for "
        "the embedded default model. gguf (the blocks, or an error where they cannot run), int8 (W8A8: linear weights "
        "quantized to int8 per output channel at load, activations per token; CPU), compressed-tensors (a W8A8 int8 "
        "checkpoint as it is; found from its config.json without the flag too) or none (expand a .gguf to float)"))
    seed: int = field(default=0, metadata=_opt("seed of the engine's default random state"))
    block_size: int = field(default=16, metadata=_opt("tokens per KV block (a power of two)"))
    max_num_seqs: int = field(default=64, metadata=_opt("most sequences in one step"))
    max_num_batched_tokens: int = field(default=2048, metadata=_opt("most tokens in one step"))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "context length served (default: the model's, capped by the KV pool)"))
    num_kv_blocks: int | None = field(default=None, metadata=_opt(
        "KV blocks in the pool (default: sized from --kv-cache-memory-gb)"))
    kv_cache_memory_gb: float | None = field(default=None, metadata=_opt(
        "memory for the KV pool, GiB (default: half the memory available once the weights are loaded, shared "
        "by the engine cores on the host, at most max_num_seqs x max_model_len tokens; logged at start)"))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "KV cache storage: auto (the model's dtype; outputs exact to HF), fp8_e4m3 (alias fp8) or fp8_e5m2 "
        "(one byte per element, no scale: twice the blocks and half the K/V a decode step reads; lossy, e4m3 "
        "the closer; CPU only)", choices=KV_CACHE_DTYPES))
    enable_prefix_caching: bool = field(default=True, metadata=_opt("reuse KV of shared prompt prefixes"))
    enable_chunked_prefill: bool = field(default=True, metadata=_opt("split long prompts across steps"))
    num_swap_blocks: int = field(default=0, metadata=_opt(
        "host-DRAM KV blocks for swapping out preempted requests (0: none; preemption then recomputes unless "
        "a KV store takes the blocks)"))
    preemption_mode: str | None = field(default=None, metadata=_opt(
        "what preemption does with a victim's KV: swap it out (host swap space, else the KV store's DRAM) "
        "or recompute it later (default: swap when --num-swap-blocks > 0 or a KV store is attached)", choices=("swap", "recompute")))
    kv_store: str = field(default="", metadata=_opt(
        "address of a running KV store (kvferry kvstore) to load prefixes from and write blocks down to"))
    kv_dram_gb: float = field(default=0.0, metadata=_opt(
        "start a node KV store with this much host DRAM, GiB (0: none unless --kv-store)"))
    kv_disk: str = field(default="", metadata=_opt("directory of the store's SSD tier (with --kv-dram-gb)"))
    kv_disk_gb: float = field(default=0.0, metadata=_opt("size of the store's SSD tier, GiB"))
    kv_remote: str = field(default="", metadata=_opt("redis:// URL of the store's remote tier"))
    kv_cluster: str = field(default="", metadata=_opt(
        "cluster KV pool shared by every node's store, mooncake://MASTER_HOST:PORT?metadata=URL (Mooncake "
        f"Store), or auto with --ray (the server starts a mooncake_master on the Ray head node); starts the node "
        f"store it needs (--kv-dram-gb, default {DEFAULT_CLUSTER_DRAM_GB} GiB with it)"))
    max_load_tokens: int = field(default=0, metadata=_opt(
        "most tokens one request may load from the KV store (0: no cap)"))
    insecure_shared_tier: bool = field(default=False, metadata=_opt(
        "run --kv-remote / --kv-cluster without authenticating what they hold (no cluster secret: unkeyed "
        "checksums, private blocks unsealed); whoever reaches the server can then read and forge every tenant's KV. "
        "Off: every value is authenticated under the cache secret"))
    # None (LLM(...) without it, as vLLM's): off. The commands' flag defaults
    # to "default" (cli_default): serving speculates wherever it pays.
    speculative: str | dict | None = field(default=None, metadata=_opt(
        'speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'; off (or null) for none; default: method auto '
        "(suffix, n-gram or a head per request, whichever held more lately; trees on the CPU) under the cost-aware "
        "controller, which drafts only at the batch sizes and acceptance where it measured a gain and "
        "otherwise runs the plain step; by itself off with --deterministic (its steps are measured without "
        "drafts), one log line says so (docs/speculative.md)",
        flag="--speculative-config", cli_default=SPECULATIVE_DEFAULT))
    kv_transfer_address: str = field(default="", metadata=_opt(
        "prefill/decode disaggregation: this core's KV transfer socket, tcp://host:port, bound to that host's "
        "interface (a wildcard host needs --kv-transfer-bind-any; peers must hold the cluster secret: "
        "--cache-secret-file) (default: off)"))
    kv_transport: str = field(default="shm", metadata=_opt(
        "how KV is sent to a decode core: shm (same host, into its pool) or tcp", choices=_KV_TRANSPORTS))
    kv_transfer_failure: str = field(default="recompute", metadata=_opt(
        "a decode core whose KV transfer fails: recompute the prompt, or fail the request",
        choices=_KV_FAILURE))
    kv_transfer_timeout_s: float = field(default=30.0, metadata=_opt(
        "lease of a KV transfer: how long a decode core waits and a prefill core holds its blocks"))
    kv_transfer_bind_any: bool = field(default=False, metadata=_opt(
        "listen for KV transfers on every interface (tcp://0.0.0.0:PORT or tcp://[::]:PORT, or any "
        "--kv-transfer-address: bind all interfaces, advertise its host); off: bind only the address's own "
        "interface and refuse a wildcard one"))
    kv_connector: str = field(default="", metadata=_opt(
        "a KV connector from outside the package, module:Class (a KVConnector with a scheduler half and a "
        "worker half), composed after the built-in ones (default: none)"))
    # kvferry serve's --tensor-parallel-size / -tp (serve/vllm_flags.py) maps onto it: no flag of its own.
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "rank processes per engine core (tensor parallelism, docs/parallelism.md; also -tp)",
        flag="--tensor-parallel-size", cli=False))
    cpu_threads_per_rank: int | None = field(default=None, metadata=_opt(
        "with --tensor-parallel-size N or --pipeline-parallel-size N: torch threads of each rank or stage "
        "(default: this host's CPUs / N)"))
    tp_all_reduce: str = field(default="shm", metadata=_opt(
        "with --tensor-parallel-size N: how the ranks sum their partial products: shm (shared memory, the "
        "same sum on every rank) or gloo (torch's, over loopback TCP)", choices=TP_ALL_REDUCES))
    # kvferry serve's --pipeline-parallel-size / -pp (serve/vllm_serve_flags.py) maps onto it.
    pipeline_parallel_size: int = field(default=1, metadata=_opt(
        "pipeline stage processes per engine core, each with its share of the layers (docs/parallelism.md; "
        "also -pp)", flag="--pipeline-parallel-size", cli=False))
    pp_micro_batches: int | None = field(default=None, metadata=_opt(
        "with --pipeline-parallel-size N: micro-batches a step is cut into, so that the stages overlap "
        "(default: up to N, at least 64 tokens each: a small decode step stays whole)"))
    enable_expert_parallel: bool = field(default=False, metadata=_opt(
        "with --tensor-parallel-size N on a mixture-of-experts model: each rank holds E/N whole experts and "
        "runs only the tokens routed to them (vLLM's expert parallelism); off: every expert is sliced over the "
        "N ranks. Attention stays split by heads; a dense model is unchanged"))
    ffn: int = field(default=0, metadata=_opt(
        "FFN worker processes holding every layer's MLP or experts, split over them (--mode afd); 0: off"))
    afd_folder: str | None = field(default=None, metadata=_opt("--mode afd's FFN sockets (serve/afd.py)", cli=False))

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"model must be a path string or None, got {self.model!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 0):
            raise ValueError(f"max_model_len must be an integer >= 0 (0: the model's), got {self.max_model_len!r}")
        if self.kv_cluster and not self.kv_store and not self.kv_dram_gb:
            self.kv_dram_gb = DEFAULT_CLUSTER_DRAM_GB  # --kv-cluster alone: the server starts the store it needs
        self.create_engine_config()  # validates every component's fields

    def create_engine_config(self) -> EngineConfig:
        if self._speculative_default():
            # The rest validated without speculation, then the default's for it.
            config = dataclasses.replace(self, speculative=None).create_engine_config()
            config.speculative = default_speculation(config)[0]
            return config
        return EngineConfig(
            model=ModelLoadConfig(self.model, self.dtype, self.device, self.seed, self.attention_backend,
                                  self.enforce_eager, self.warm_up, self.deterministic, self.quantization),
            cache=CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory_gb,
                              self.enable_prefix_caching, self.num_swap_blocks, self.kv_cache_dtype),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len or 0,
                                      self.enable_chunked_prefill, self.preemption_mode),
            speculative=SpeculativeConfig.parse(self.speculative),
            kv_tiers=KVTierConfig(kv_store=self.kv_store, kv_dram_gb=self.kv_dram_gb, kv_disk=self.kv_disk,
                                  kv_disk_gb=self.kv_disk_gb, kv_remote=self.kv_remote, kv_cluster=self.kv_cluster,
                                  max_load_tokens=self.max_load_tokens,
                                  insecure_shared_tier=self.insecure_shared_tier),
            kv_transfer=KVTransferConfig(self.kv_transfer_address, self.kv_transport, self.kv_transfer_failure,
                                         self.kv_transfer_timeout_s, self.kv_transfer_bind_any),
            kv_connector=self.kv_connector,
            parallel=ParallelConfig(self.tensor_parallel_size, self.cpu_threads_per_rank, self.tp_all_reduce,
                                    self.pipeline_parallel_size, self.pp_micro_batches,
                                    enable_expert_parallel=self.enable_expert_parallel,
                                    afd=AFDConfig(self.ffn, self.afd_folder)),
        )

    def _speculative_default(self) -> bool:
        return isinstance(self.speculative, str) and self.speculative.strip().lower() == SPECULATIVE_DEFAULT

    def default_speculation_line(self) -> str | None:
        """What the default speculation does here, for the start's log (None: a config was given)."""
        if not self._speculative_default():
            return None
        return default_speculation(dataclasses.replace(self, speculative=None).create_engine_config())[1]

    # -- command line -----------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, only: "tuple[str, ...] | None" = None) -> argparse.ArgumentParser:
        """One flag per field (``only``: these fields alone; the others keep
        their defaults); a bool gets --x / --no-x. The help shows each
        default (kvferry.cli_parser.HelpFormatter)."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(EngineArgs):
            if only is not None and f.name not in only:
                continue
            meta = dict(f.metadata)
            flag = meta.pop("flag", "--" + f.name.replace("_", "-"))
            if not meta.pop("cli", True):
                continue  # another module defines the flag (see the field)
            meta["dest"] = f.name
            default = meta.pop("cli_default", f.default)
            if f.type in ("bool", bool):
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, **meta)
            else:
                group.add_argument(flag, type=_cli_type(f.type), default=default, **meta)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        # A field whose flag another module defines is that module's to map (cli=False).
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                      if hasattr(args, f.name) and f.metadata.get("cli", True)})


def _cli_type(annotation: Any) -> type:
    """The argparse type of a field annotation (annotations are strings here)."""
    text = str(annotation)
    for name, kind in (("int", int), ("float", float)):
        if text.startswith(name):
            return kind
    return str
