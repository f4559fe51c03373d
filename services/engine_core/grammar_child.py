"""A grammar compiler's child process (see grammar_compiler.py): compiles one
constraint at a time and sends back xgrammar's serialized result, until the
engine core closes the connection or kills it for taking too long. Children are
forked by the zygote (grammar_zygote.py)."""
from __future__ import annotations

from multiprocessing.connection import Connection

from services.common.errors import InvalidArgument
from services.engine_core.grammar import compile_constraint

# Compiled grammars a child keeps for reuse (a JSON schema's is tens of KB).
CACHE_BYTES = 64 << 20

# What a child sends: ("ok", compiled JSON); ("invalid", field, problem) for a
# constraint that does not compile; ("failed", message) for anything else.


def serve_compiles(conn: Connection, tokenizer_info, max_threads: int) -> None:
    import xgrammar

    compiler = xgrammar.GrammarCompiler(tokenizer_info, max_threads=max_threads,
                                        cache_limit_bytes=CACHE_BYTES)
    while True:
        try:
            params = conn.recv()
        except EOFError:  # the engine core is done with this child
            return
        conn.send(_compile(compiler, params))


def _compile(compiler, params) -> tuple:
    try:
        return ("ok", compile_constraint(compiler, params).serialize_json())
    except InvalidArgument as e:
        return ("invalid", e.field, str(e).removeprefix(f"{e.field}: "))
    except Exception as e:  # noqa: BLE001 - any other failure is the request's answer
        return ("failed", f"the grammar compiler failed: {e}")
