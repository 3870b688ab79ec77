"""`rayllm-rl serve MODEL_PATH [--port 0] [--backend local|ray] [--api-key KEY] [key.sub=value ...]`.

Opens a TinkerService on MODEL_PATH (the job's learner and replica roles, `trainer.backend` local or ray), binds
127.0.0.1 on the port given (0: the OS picks one; the socket is bound here and handed to uvicorn, so the port is
known before anything connects), prints one line `rayllm-rl serve: listening on http://127.0.0.1:PORT` once it
answers, and serves Tinker's HTTP API (`server.py`) until SIGINT or SIGTERM; then it stops taking requests and
closes the service. Point the unmodified SDK at it:
`tinker.ServiceClient(base_url="http://127.0.0.1:PORT", api_key="tml-...")`.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import threading
from typing import Any

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
"""How long uvicorn may take to start answering on the bound socket."""
CLOSE_TIMEOUT_S = 120.0
"""How long closing the service (its roles) may take before the command exits anyway, saying so."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayllm-rl serve", description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("model_path", metavar="MODEL_PATH", help="the base model: a local HF directory (as model.path)")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: the OS picks; the line "
                   "printed at start says which)")
    p.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="trainer.backend of the roles: one process (local) or Ray actors (ray)")
    p.add_argument("--api-key", help="the one X-API-Key accepted (must start with 'tml-'); default: "
                   "$TINKER_API_KEY, else any key starting with 'tml-'")
    p.add_argument("--state-dir", default="runs/tinker-serve", help="where the registry of training runs and "
                   "checkpoints lives; a later server on the same directory resumes from it (default: %(default)s)")
    p.add_argument("--fwdbwd-chunk-len", type=int, default=1024, help="datums per forward_backward request the SDK "
                   "is told to send (its ClientConfigResponse.fwdbwd_max_chunk_len; default: %(default)s)")
    p.add_argument("--op-timeout", type=float, default=900.0, help="seconds one call on the service may take "
                   "(default: %(default)s)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides for the roles")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_intermixed_args(argv)  # overrides may come after the flags
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        print(f"rayllm-rl serve: {bad} are not key.sub=value overrides", file=sys.stderr)
        return 2
    from rayllm_rl.tinker.server.state import Options, accept_tml_keys, expect_key

    key = args.api_key or os.environ.get("TINKER_API_KEY")
    try:
        check = expect_key(key) if key else accept_tml_keys
    except ValueError as error:
        print(f"rayllm-rl serve: --api-key/TINKER_API_KEY: {error}", file=sys.stderr)
        return 2
    if args.fwdbwd_chunk_len < 1 or args.op_timeout <= 0:
        print("rayllm-rl serve: --fwdbwd-chunk-len and --op-timeout must be positive", file=sys.stderr)
        return 2
    sock = bind(args.port)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops it as SIGINT does: service closed
    try:
        from rayllm_rl.tinker.service import TinkerService

        service = None
        try:
            service = TinkerService(args.model_path, backend=args.backend, overrides=list(args.overrides))
            # the service opens its roles at the first training client; a model that cannot be found fails now
            from rayllm_rl.hub import resolve_model_path

            resolve_model_path(args.model_path, service.config.model.revision)
        except Exception as error:  # noqa: BLE001 - said in one line: the model or the roles did not open
            print(f"rayllm-rl serve: cannot serve {args.model_path}: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)
            if service is not None:
                close(service)  # a Ray it started
            return 1
        # A Ray the service started (backend ray) put its own SIGTERM handler in (one that aborts the process): ours
        # again, so SIGTERM stops the server and closes the roles.
        signal.signal(signal.SIGTERM, _interrupt)
        try:
            run(service, sock, check, state_dir=args.state_dir,
                options=Options(op_timeout_s=args.op_timeout, fwdbwd_max_chunk_len=args.fwdbwd_chunk_len))
        except KeyboardInterrupt:
            pass
        finally:
            close(service)
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def bind(port: int) -> socket.socket:
    """A listening TCP socket on 127.0.0.1:`port` (0: the OS picks); its port is known at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError as error:
        sock.close()
        raise SystemExit(f"rayllm-rl serve: cannot bind {HOST}:{port}: {error}") from None
    sock.listen(128)
    return sock


def run(service: Any, sock: socket.socket, api_key_check, *, state_dir: str, options=None) -> None:
    """Serve `service` on the bound `sock` until SIGINT/SIGTERM (which uvicorn turns into a graceful stop of at
    most 5 s, then re-raises: KeyboardInterrupt here). Prints the listening line once uvicorn answers."""
    import uvicorn

    from rayllm_rl.tinker.server.app import make_app

    app = make_app(service, api_key_check, state_dir=state_dir, options=options)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=5))
    port = sock.getsockname()[1]

    async def serve():
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        for _ in range(int(START_TIMEOUT_S / 0.05)):
            if server.started or task.done():
                break
            await asyncio.sleep(0.05)
        if server.started:
            print(f"rayllm-rl serve: listening on http://{HOST}:{port}", flush=True)
        elif not task.done():
            server.should_exit = True
            print(f"rayllm-rl serve: the server did not start within {START_TIMEOUT_S:g} s", file=sys.stderr)
        await task
    asyncio.run(serve())


def close(service: Any) -> None:
    """`service.close()`, at most CLOSE_TIMEOUT_S seconds (a role that does not stop is reported, not waited on)."""
    errors: list[BaseException] = []

    def _close():
        try:
            service.close()
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
    thread = threading.Thread(target=_close, name="tinker-serve-close", daemon=True)
    thread.start()
    thread.join(CLOSE_TIMEOUT_S)
    if thread.is_alive():
        print(f"rayllm-rl serve: the service did not close within {CLOSE_TIMEOUT_S:g} s; exiting anyway",
              file=sys.stderr, flush=True)
    elif errors:
        print(f"rayllm-rl serve: closing the service failed: {errors[0]!r}", file=sys.stderr, flush=True)
