"""`sled serve`: load the target and serve it until interrupted."""
from __future__ import annotations

import asyncio
import contextlib


def run_serve(args) -> int:
    from verify_server.config import ServerConfig
    from verify_server.server import serve_forever
    from sled_cli.models import resolve_model
    from verify_server.target import Target

    config = ServerConfig(max_draft_tokens=args.max_draft_tokens, max_sessions=args.max_sessions,
                          max_batch_sessions=args.max_batch_sessions,
                          context_length=args.context_length)
    target = Target.load(resolve_model(args.model), dtype=args.dtype, device=args.device,
                         trust_remote_code=args.trust_remote_code, context_length=args.context_length,
                         name=args.model)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_forever(target, config, args.host, args.port, args.metrics_port))
    return 0
