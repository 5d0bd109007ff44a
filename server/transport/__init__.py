"""The gRPC transport: servicer, op handlers, error boundary, interceptors, app, CLI."""
