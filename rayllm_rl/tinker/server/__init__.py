"""`rayllm-rl serve`: Tinker's wire protocol (HTTP, JSON and the SDK's protobuf) in front of a `TinkerService`, for
the unmodified `tinker` SDK (docs/tinker-api.md). `app.make_app` is the ASGI app, `main` the command, `wire` the
codec; the other modules hold the server's state (futures, per-client order, the checkpoint registry) and its
training and sampling routes."""
