"""The server's domain core: sessions, TensorArrays, op semantics. No transport."""
