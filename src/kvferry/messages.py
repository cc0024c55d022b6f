"""Messages between the front end and an engine core. No torch.

Every process boundary speaks these types, through one serializer
(``encode`` / ``decode`` below: msgspec msgpack). The front end owns text
(tokenization, chat templates, detokenization, stop strings, n > 1 fan-out);
the core owns token ids, scheduling and the forward pass::

    front end                                   engine core
    ---------                                   -----------
    EngineCoreRequest  ------------------------>  scheduler.add_request
    EngineCoreAbort    ------------------------>  scheduler.finish_requests
    EngineCoreShutdown ------------------------>  abort everything, exit
    EngineCorePurgeTenant --------------------->  drop a tenant's unused cached blocks
    EngineCoreDropPublicBlocks ---------------->  unpin and drop a deleted public prefix's own blocks
    EngineCoreHello    ------------------------>  answer EngineCoreReady again (join, health check)
    EngineCoreFirstToken ---------------------->  the router's word on a disagg request's first token
                       <------------------------  EngineCoreReady (once, after loading)
                       <------------------------  EngineCoreOutputs (one per step)

Each direction is one tagged union (``CoreInput`` / ``CoreOutput``), so a
socket carries one message type per direction and a decoder knows every
variant.

Prefill/decode disaggregation (a router drives two cores, ``kvferry.disagg``)::

    router                      decode core D                       prefill core P
    ------                      -------------                       --------------
    request(role="decode") -->  prefix hit; blocks for the rest of
                                the prompt; WAITING_FOR_KV
           <-- output.kv_destination (address, block ids, tokens
                                D already has, transfer id, lease)
    request(role="prefill", dest=...) ------------------------------>  computes the prompt (its own
                                                                       prefix cache applies)
                                <== KV of the blocks D lacks, layer by layer, as each layer finishes
                                <== KVTransferDone: first token, output ids (penalty counts),
                                    seeded generator state, checksum; with speculation the
                                    core's signature and the head's hidden state (a draft
                                    model's KV came as layers after the target's)
                                verify every layer + checksum
                                ==> KVTransferAck ==================>  frees its blocks (or at lease end)
           <------------------------------------------------------- output: the first token,
                                                                     finish_reason "prefilled"
           <-- outputs from the second token on (the first token is
               P's to report); finish_reason as colocated

On a timeout, error or checksum mismatch D recomputes the prompt itself, or,
with ``--kv-transfer-failure fail``, finishes the request with
finish_reason "error"; tokens never come from partially received KV. Either
way D first sends an output with ``kv_transfer_error`` set. When P's
KVTransferDone arrived (only its KV was bad), D keeps P's first token and
its outputs still start at the second. Without it (D's lease ended, or P
gave up) P may still have reported its first token to the router, which
may have streamed it: D cannot know, so it samples nothing and says so
(``kv_first_token_wanted``), and the router, which alone knows, answers
with an ``EngineCoreFirstToken``: P's token, which D appends and continues
after, or none, and then D samples the first token itself and the router
drops P's should it still come. So D never emits a token P already sent,
nor continues from a first token the client did not get. A router that
retries the prefill on another core passes the same KVDestination while
its lease runs.

A core output carries only what a step added (``new_token_ids``, zero or
more: speculative decoding accepts several per step), never a whole history.
"""
from __future__ import annotations

import msgspec

from typing import Union

from kvferry.sampling import SamplingParams
from kvferry.types.cache_scope import CacheScope
from kvferry.types.kv_events import KVEvent
from kvferry.types.logprobs import TokenLogprobs
from kvferry.types.stats import SchedulerStats

__all__ = [
    "KVDestination", "KVTransferAck", "KVTransferDone", "KVLayerChunk", "KVTransferParams", "KVWire",
    "CoreInput", "CoreOutput", "EngineCoreAbort", "EngineCoreFirstToken", "EngineCoreOutput", "EngineCoreOutputs",
    "EngineCoreReady", "EngineCoreHello", "EngineCorePurgeTenant", "EngineCoreDropPublicBlocks", "EngineCoreRequest",
    "EngineCoreShutdown",
    "SchedulerStats", "decode", "encode",
]


class KVDestination(msgspec.Struct, kw_only=True):
    """Where a prefill core writes one request's KV: reported by the decode
    core, passed on by the router unchanged."""

    # Unique per transfer (a request retried on another prefill core keeps it).
    transfer_id: str
    # The decode core's transfer socket (tcp://host:port).
    address: str
    # The decode core's KV pool as a named shared-memory segment ("": not in
    # shared memory, so only the socket transport reaches it).
    shm_name: str = ""
    # Blocks to fill, in order: the request's blocks from
    # num_cached_tokens // block_size to the end of its prompt.
    block_ids: list[int]
    # Prompt tokens whose KV the decode core already has (its prefix hit, a
    # multiple of block_size): their blocks are not sent.
    num_cached_tokens: int
    block_size: int
    # The decode core waits this long for the whole transfer; a prefill core
    # writes nothing into shared memory after ``deadline`` (time.monotonic()
    # of the decode core, so shared memory (one host) can compare it).
    lease_s: float
    deadline: float
    # The decode core's tensor-parallel ranks: rank d's pool holds KV heads
    # [d * K / tp_size, (d + 1) * K / tp_size) and, in shared memory, is
    # segment ``shm_name`` (rank 0) or ``f"{shm_name}-rank{d}"``
    # (kvferry.disagg.heads). Every rank's chunk reports go to ``address``.
    tp_size: int = 1


class KVTransferParams(msgspec.Struct, kw_only=True):
    """This request's part in a disaggregated pair."""

    # "decode": wait for the prompt's KV and report a KVDestination;
    # "prefill": compute the prompt, stream its KV to ``dest``, report the
    # first token and finish with "prefilled".
    role: str
    dest: KVDestination | None = None


class EngineCoreRequest(msgspec.Struct, kw_only=True, tag=True):
    """One sequence to generate (the front end fans n > 1 out into n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every end-of-sequence id of the model (Llama 3 has two).
    eos_token_ids: list[int]
    # time.monotonic() on the front end (CLOCK_MONOTONIC: one clock per host).
    arrival_time: float
    # Where the request's KV blocks are keyed and whose they are: tenant
    # namespace, public prefix blocks, quota, tenant and weight, as the
    # server derived them from the caller's API key (never from client
    # input). One typed field, so the core gets exactly what the front end
    # built. The default: one tenant, everything private.
    cache_scope: CacheScope = CacheScope()
    # Prefill/decode disaggregation; None: the core does both phases.
    kv_transfer: KVTransferParams | None = None


class EngineCoreAbort(msgspec.Struct, kw_only=True, tag=True):
    """Finish these requests now (a client left, or a stop string matched)."""

    request_ids: list[str]


class EngineCoreShutdown(msgspec.Struct, kw_only=True, tag=True):
    """Abort whatever runs and exit (the front end is going away)."""


class EngineCorePurgeTenant(msgspec.Struct, kw_only=True, tag=True):
    """Drop the tenant's cached blocks that no running request uses (an
    admin's DELETE /v1/kv/tenants/{tenant}). The core answers with an
    EngineCoreOutputs whose ``purged`` maps ``purge_id`` to the count."""

    purge_id: str
    tenant: str


class EngineCoreDropPublicBlocks(msgspec.Struct, kw_only=True, tag=True):
    """A public prefix's declaration was deleted: unpin its public blocks
    from ``first_block`` on (those before it are still declared by another
    prefix that shares them) and drop those no running request uses. The
    core keys ``token_ids`` (the prefix's whole blocks) in
    ``public_namespace`` as the declaration's prefill did. Answered like
    EngineCorePurgeTenant (``purged``: ``purge_id`` -> blocks dropped)."""

    purge_id: str
    public_namespace: str
    token_ids: list[int]
    first_block: int = 0


class EngineCoreHello(msgspec.Struct, kw_only=True, tag=True):
    """Send EngineCoreReady again. A router that joins a running core (or
    checks that it is alive) asks with this; the core's input thread answers
    at once, even during a long step. ``reply_to`` is the routing id of the
    sender's output socket: once the hello carries the core's token, the
    core sends its outputs there, and to no other peer of that socket."""

    reply_to: bytes = b""


class EngineCoreFirstToken(msgspec.Struct, kw_only=True, tag=True):
    """The router's word to a decode core that asked for it
    (``kv_first_token_wanted``): ``token_ids`` is the prefill core's first
    token, already streamed to the client (the core appends it and samples
    from the second on), or empty when none was: the core samples the first
    token itself."""

    request_id: str
    token_ids: list[int]


class EngineCoreOutput(msgspec.Struct, kw_only=True):
    """What one step did for one request."""

    request_id: str
    # Tokens accepted this step, in order (0..k+1 with speculation).
    new_token_ids: list[int]
    # One entry per new token when the request asked for logprobs.
    new_logprobs: list[TokenLogprobs] | None = None
    # Once, with the output of the step that computed the end of the prompt,
    # when the request asked for prompt logprobs: one entry per prompt token
    # (None for the first).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's embedding (its only output; no tokens).
    pooled: list[float] | None = None
    # "stop" | "length" | "abort" once the core finished the request.
    finish_reason: str | None = None
    # The stop token id that ended it (EOS is reported as None, as in vLLM).
    stop_reason: int | str | None = None
    # Prompt tokens served from the prefix cache on first scheduling.
    num_cached_tokens: int = 0
    # time.monotonic() when the core first scheduled the request; set on the
    # request's first output only (for the queue-time metric).
    first_scheduled_time: float | None = None
    # A decode-role request's KV destination, once its blocks are allocated
    # (its first output; no tokens). The router passes it to a prefill core.
    kv_destination: KVDestination | None = None
    # Why a disaggregated request ended in "error", or what a decode core
    # did instead of using a failed transfer (e.g. "recomputed: checksum").
    kv_transfer_error: str | None = None
    # With kv_transfer_error, recomputing: the prefill core's first token
    # never reached this core, which samples nothing until the router's
    # EngineCoreFirstToken says what the client got.
    kv_first_token_wanted: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, kw_only=True, tag=True):
    """One step's outputs for every request that changed.

    The core also sends one (maybe with no outputs) after applying inputs
    while idle, so that ``stats`` never goes stale after an abort."""

    outputs: list[EngineCoreOutput]
    # time.monotonic() when the step's results were ready.
    timestamp: float = 0.0
    # The scheduler's state after the step (for /metrics).
    stats: SchedulerStats | None = None
    # Set on the last message of a core that is dying: why (e.g. a failed
    # integrity check). The front end then fails every open request.
    engine_error: str | None = None
    # Answers to EngineCorePurgeTenant / EngineCoreDropPublicBlocks: purge_id -> blocks dropped.
    purged: dict[str, int] | None = None
    # Block events since the previous message (stored / removed hashes):
    # the router's view of which prefixes this core holds.
    kv_events: list[KVEvent] | None = None
    # The step this message reports: tokens it computed and its wall time
    # (0 for a message sent while idle); the router fits its step-time model
    # on these.
    num_scheduled_tokens: int = 0
    step_duration_s: float = 0.0


class TPRank(msgspec.Struct, kw_only=True, array_like=True):
    """One tensor-parallel rank of a core, as its rank 0 sees it (the
    admin's view, GET /v1/admin/workers): a few fields, so a heartbeat's
    answer stays small."""

    rank: int
    pid: int
    cpu_threads: int
    alive: bool
    node: str = ""  # its Ray node id under --ray ("": the core's host)


class EngineCoreReady(msgspec.Struct, kw_only=True, tag=True):
    """The core's handshake, sent once the model is loaded: the facts the
    front end needs to validate requests before they cross the socket."""

    pid: int
    # The context length served (the model's, the user's cap, the KV pool's).
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    model_fingerprint: str
    # The HF folder the core loaded (a GGUF's converted folder): the front
    # end reads the same tokenizer from it.
    model_path: str
    # Every end-of-sequence id (from the tokenizer, else the model config).
    eos_token_ids: list[int]
    # The KV dtype keyed into block hashes (a router recomputes them).
    kv_dtype: str = ""
    # Its speculation (``kvferry.spec.speculation_signature``; "": none).
    # Prefill and decode cores of one server must agree.
    speculative: str = ""
    # Its tensor-parallel ranks, rank 0 first ([]: one process). Sent again
    # with every heartbeat's answer, so ``alive`` is as fresh as the beat.
    ranks: list[TPRank] = []
    # With pipeline parallelism ``ranks`` are its stages, rank 0 the first.
    pipeline_parallel_size: int = 1
    # With --ffn M (attention/FFN disaggregation) ``ranks`` 1..M are its FFN workers.
    ffn_workers: int = 0


# -- prefill core -> decode core (its transfer socket) -----------------------------
class KVLayerChunk(msgspec.Struct, kw_only=True, tag=True):
    """One layer of a transfer, as soon as the prefill core computed it.
    Over TCP the layer's blocks follow as the next frame of the same
    multipart message (``[2, n, block_size, kv_heads, head_dim]`` raw bytes
    in the pool's dtype, zero-copy); over shared memory nothing follows: the
    bytes are already in the decode core's pool and this says so."""

    transfer_id: str
    # 0 .. L-1: the target's layers; L ..: the draft model's (method "draft").
    layer: int
    block_ids: list[int]  # decode-core block ids the chunk fills
    has_payload: bool = False
    # The first ``num_final_blocks`` of ``block_ids`` hold their final bytes
    # (a trailing block the step only partly computed is sent again, whole,
    # by a later chunk); ``checksum`` is the xxh3-64 of those blocks' bytes
    # in payload order (transport.chunk_checksum). The decode core verifies
    # each chunk as it lands, so nothing is left to hash after the last one.
    num_final_blocks: int = 0
    checksum: int = 0
    # Global KV heads [head_start, head_stop) of the layer (the payload's
    # heads; over shared memory those written into the decode rank that holds
    # them, kvferry.disagg.heads). 0, 0: every head of a one-rank pool.
    head_start: int = 0
    head_stop: int = 0


class KVTransferDone(msgspec.Struct, kw_only=True, tag=True):
    """The last message of a transfer: what decode needs besides the KV."""

    transfer_id: str
    num_layers: int
    block_ids: list[int]  # every block the transfer filled
    # The tokens the prefill core sampled (the first token).
    output_token_ids: list[int]
    # torch.Generator.get_state() of a seeded request after its first token.
    generator_state: bytes = b""
    # Set when the prefill core gave up (aborted, lease over): discard.
    error: str = ""
    # The prefill core's speculation (``kvferry.spec.speculation_signature``):
    # what it ships besides the target's KV. The decode core refuses a
    # transfer whose signature differs from its own.
    speculative: str = ""
    # Method "head": the target's last hidden state at the row that sampled
    # the first token ([hidden_size] raw bytes in ``hidden_state_dtype``, as
    # the model runs), with its xxh3-64, so the decode core's head drafts at
    # its first step. (Method "draft" ships the draft model's KV instead, as
    # layers num_target_layers .. num_layers - 1 of the same transfer.)
    hidden_state: bytes = b""
    hidden_state_dtype: str = ""
    hidden_state_checksum: int = 0
    # The prefill core's tensor-parallel ranks, each of which sends its own
    # heads' chunks on its own link: with more than one, chunks may still
    # arrive after this message (the decode core completes, and acknowledges,
    # once every head of every block landed, or fails at the deadline).
    num_ranks: int = 1


class KVTransferAck(msgspec.Struct, kw_only=True, tag=True):
    """Decode core -> prefill core: the transfer is verified (or refused);
    the prefill core may free its blocks."""

    transfer_id: str
    ok: bool
    reason: str = ""


KVWire = Union[KVLayerChunk, KVTransferDone, KVTransferAck]

# One message type per direction.
CoreInput = Union[EngineCoreRequest, EngineCoreAbort, EngineCoreShutdown, EngineCorePurgeTenant, EngineCoreHello,
                  EngineCoreFirstToken, EngineCoreDropPublicBlocks]
CoreOutput = Union[EngineCoreReady, EngineCoreOutputs]


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, message_type: object):
    """Decode bytes into ``message_type`` (validating every field)."""
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decoder.decode(data)
