"""Op semantics: TensorFlow's op-level argument checks in front of the domain state.

Pure Python over NumPy arrays and sessions; no gRPC. Each function takes
already-decoded inputs and returns arrays (or handles), raising
``gradserve.errors`` types with TensorFlow's messages.
"""
