"""GrammarCompiler: compiles structured-outputs constraints in child processes,
each compile under a time limit (--structured-outputs-compile-timeout).

Why processes: an xgrammar compile cannot be interrupted, and some constraints
take minutes (a JSON-schema pattern `^[a-z]{1,50000}$` took 176 s, then
failed), holding a core all along. A child past the limit is killed and its
request refused with INVALID_ARGUMENT. Up to MAX_CHILDREN compile at once, so
other constrained requests do not queue behind a slow one, and a request whose
caller leaves has its compile stopped too.

Children are forked by a zygote process (grammar_zygote.py) that has imported
xgrammar and the tokenizer's description once, so a new child is ready at
once. The description is built here, once; a result comes back as xgrammar's
serialized CompiledGrammar. Compiled grammars are kept (LRU, CACHE_BYTES) for
the next request with the same constraint.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from services.common.errors import Cancelled, FailedPrecondition, InvalidArgument, LLMServeError
from services.common.model_store import resolve_model
from services.common.structured_outputs import FIELD, StructuredOutputsParams
from services.engine_core.grammar_zygote import Zygote

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)
MAX_CHILDREN = 4  # compiles at once; more wait for a child to free up
MAX_IDLE_CHILDREN = 2  # kept for the next compiles; the others exit
CACHE_BYTES = 256 << 20
_START_TIMEOUT_S = 120.0  # the zygote's start (imports xgrammar and torch)
_POLL_S = 0.05  # how often a waiting compile checks whether its caller left


class GrammarCompiler:
    """Thread-safe: the engine loop compiles on several threads at once."""

    def __init__(self, model: str, vocab_size: int, timeout_s: float):
        self.model = model
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._cache = _CompiledCache(CACHE_BYTES)
        self._setup_lock = threading.Lock()
        self._tokenizer_info: xgrammar.TokenizerInfo | None = None
        self._zygote: Zygote | None = None
        self._changed = threading.Condition()
        self._idle: list[_Child] = []
        self._children: set[_Child] = set()  # idle, busy and starting ones
        self._num_children = 0

    def compile(self, params: StructuredOutputsParams,
                cancelled: threading.Event | None = None) -> xgrammar.CompiledGrammar:
        """Raises InvalidArgument naming the constraint when it does not compile or
        not within timeout_s; Cancelled once `cancelled` is set."""
        params.validate()
        key = _cache_key(params)
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile_in_child(params, cancelled)
            self._cache.put(key, compiled)
        return compiled

    def _compile_in_child(self, params, cancelled) -> xgrammar.CompiledGrammar:
        import xgrammar

        zygote = self._set_up()
        child = self._acquire(zygote)
        try:
            reply = child.compile(params, self.timeout_s, cancelled)
        except BaseException:
            self._retire(child)
            raise
        self._release(child)
        if reply[0] == "ok":
            return xgrammar.CompiledGrammar.deserialize_json(reply[1], self._tokenizer_info)
        if reply[0] == "invalid":
            raise InvalidArgument(reply[1], reply[2])
        raise LLMServeError(reply[1])

    @property
    def num_compiling(self) -> int:
        """Children compiling (or starting) now."""
        with self._changed:
            return self._num_children - len(self._idle)

    def close(self) -> None:
        """Stops every child (the engine core is shutting down)."""
        with self._changed:
            children, self._idle = list(self._children), []
        for child in children:
            child.stop()
        with self._setup_lock:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None

    # ---- children ------------------------------------------------------------------

    def _set_up(self) -> Zygote:
        """The zygote, started on first use with the tokenizer's description for
        xgrammar (it needs the model's tokenizer, which a model serving only
        unconstrained requests may lack), and again if it died."""
        with self._setup_lock:
            if self._zygote is None or self._zygote.process.poll() is not None:
                self._retire_idle()  # children die with their zygote
                self._zygote = self._start_zygote()
                logger.info("grammar compiler ready for %s (%d tokens; compiles in child "
                            "processes, each within %g s)", self.model, self.vocab_size,
                            self.timeout_s)
            return self._zygote

    def _start_zygote(self) -> Zygote:
        zygote = Zygote(min(8, os.cpu_count() or 1))  # imports while the tokenizer loads
        try:
            if self._tokenizer_info is None:
                self._tokenizer_info = self._build_tokenizer_info()
            zygote.hand_over(self._tokenizer_info.serialize_json(), _START_TIMEOUT_S)
        except BaseException as e:
            zygote.close()
            if isinstance(e, OSError):
                raise FailedPrecondition(str(e)) from None
            raise
        return zygote

    def _build_tokenizer_info(self) -> xgrammar.TokenizerInfo:
        import xgrammar

        from services.common.tokenizer import load_tokenizer  # transformers: on use too
        try:
            tokenizer, _ = load_tokenizer(resolve_model(self.model))
        except (OSError, ValueError) as e:
            raise FailedPrecondition(f"structured outputs need the model's tokenizer, "
                                     f"which {self.model} does not have: {e}") from None
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)

    def _acquire(self, zygote: Zygote) -> _Child:
        """An idle child, or a new one when fewer than MAX_CHILDREN exist."""
        with self._changed:
            self._changed.wait_for(lambda: self._idle or self._num_children < MAX_CHILDREN)
            if self._idle:
                return self._idle.pop()
            self._num_children += 1
        try:
            child = _Child(*zygote.fork())
        except BaseException:
            with self._changed:
                self._num_children -= 1
                self._changed.notify()
            raise
        with self._changed:
            self._children.add(child)
        return child

    def _release(self, child: _Child) -> None:
        with self._changed:
            if len(self._idle) < MAX_IDLE_CHILDREN:
                self._idle.append(child)
                self._changed.notify()
                return
        self._retire(child)

    def _retire_idle(self) -> None:
        with self._changed:
            idle, self._idle = self._idle, []
        for child in idle:
            self._retire(child)

    def _retire(self, child: _Child) -> None:
        child.stop()
        with self._changed:
            self._children.discard(child)
            self._num_children -= 1
            self._changed.notify()


class _Child:
    """One compile child and the connection to it; used by one thread at a time."""

    def __init__(self, pid: int, conn: Connection):
        self.pid = pid
        self.conn = conn

    def compile(self, params: StructuredOutputsParams, timeout_s: float,
                cancelled: threading.Event | None) -> tuple:
        """The child's reply; raises (and leaves the child to be stopped) when the
        compile runs past timeout_s or its caller leaves."""
        try:
            self.conn.send(params)
        except OSError:
            raise LLMServeError("the grammar compiler's process is gone; retry") from None
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
            if cancelled is not None and cancelled.is_set():
                raise Cancelled("the request was cancelled while its grammar compiled")
            if time.monotonic() >= deadline:
                raise InvalidArgument(
                    f"{FIELD}.{params.kind}", f"did not compile within {timeout_s:g} s (the "
                    "server's --structured-outputs-compile-timeout) and was stopped; simplify "
                    "the constraint (a pattern repeating a class thousands of times, such as "
                    "[a-z]{1,50000}, takes minutes)")
        return self._receive()

    def _receive(self) -> tuple:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise LLMServeError("the grammar compiler's process died compiling it") from None

    def stop(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it
        except ProcessLookupError:
            pass
        self.conn.close()


class _CompiledCache:
    """Compiled grammars by constraint, least recently used first out, up to a
    total of max_bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple, xgrammar.CompiledGrammar] = \
            collections.OrderedDict()
        self._bytes = 0

    def get(self, key: tuple) -> xgrammar.CompiledGrammar | None:
        with self._lock:
            compiled = self._entries.get(key)
            if compiled is not None:
                self._entries.move_to_end(key)
            return compiled

    def put(self, key: tuple, compiled: xgrammar.CompiledGrammar) -> None:
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = compiled
            self._bytes += compiled.memory_size_bytes
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                _, oldest = self._entries.popitem(last=False)
                self._bytes -= oldest.memory_size_bytes


def _cache_key(params: StructuredOutputsParams) -> tuple:
    kind = params.kind
    value = {"json": params.json_text, "regex": params.regex, "grammar": params.grammar,
             "choice": json.dumps(params.choice), "json_object": ""}[kind]
    return kind, value, params.disable_any_whitespace
