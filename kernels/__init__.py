"""Array math of the ops, on NumPy (CPU) or CuPy (CUDA), and device selection.

Domain layer: imports NumPy (CuPy only inside ``backend_cuda``) and the shared
modules, never gRPC or protobuf.
"""
