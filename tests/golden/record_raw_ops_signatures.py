"""Record the Python signatures and output names of the ``tf.raw_ops`` the SDK mirrors.

``client.raw_ops`` promises TensorFlow's op names, argument names, defaults and output
order; ``tests/client/test_raw_ops_signatures.py`` holds it to this file. TensorFlow is
never a dependency of gradserve: install it by hand to re-record (``make golden``).
"""

from __future__ import annotations

import inspect
import json
import pathlib

OUT = pathlib.Path(__file__).parent / "raw_ops_signatures.json"
OPS = [
    "TensorArrayV3", "TensorArrayWriteV3", "TensorArrayReadV3", "TensorArrayGatherV3",
    "TensorArrayScatterV3", "TensorArrayConcatV3", "TensorArraySplitV3", "TensorArraySizeV3",
    "TensorArrayCloseV3", "TensorArrayGradV3", "TensorArrayGradWithShape", "StopGradient",
    "BlockLSTM", "BlockLSTMV2", "BlockLSTMGrad", "BlockLSTMGradV2",
]  # fmt: skip


def main() -> None:
    import tensorflow as tf
    from tensorflow.python.framework import op_def_registry

    ops = {}
    for op in OPS:
        params = inspect.signature(getattr(tf.raw_ops, op)).parameters.values()
        ops[op] = {
            # [name] for a required argument, [name, default] for an optional one
            "params": [[p.name] if p.default is p.empty else [p.name, p.default] for p in params],
            "outputs": [arg.name for arg in op_def_registry.get(op).output_arg],
        }
    meta = {"recorded_with": f"tensorflow {tf.__version__}", "ops": ops}
    OUT.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"{len(ops)} op signatures written to {OUT}")


if __name__ == "__main__":
    main()
