"""The gRPC transport: servicer, op handlers, error boundary, admission, auth, app, CLI."""
