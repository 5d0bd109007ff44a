"""Running op traces in TensorFlow for the ``record_*.py`` scripts, surviving its crashes.

A trace is a list of steps ``{op, args, out?}`` in the golden trace format
(``trace_format``), ``op`` a ``tf.raw_ops`` name. ``record`` runs traces in a worker process
(the calling script, started with ``--worker``) that reports each step's expectation
as it completes; where TensorFlow kills the worker (it does, on some inputs), the trace
ends with the step that killed it, marked ``{"tf_crashed": true}``, and a fresh worker
takes the next trace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from trace_format import STRING, encode, result, tensor_value


def run_step(tf, step: dict, env: dict) -> dict:
    """One step in TensorFlow eagerly; its expectation in the golden format."""
    args = {}
    for key, value in step["args"].items():
        if isinstance(value, str) and value.startswith("$"):
            args[key] = env[value[1:]]
        elif isinstance(value, dict):
            # An empty object array has no dtype of its own: strings are named.
            dtype = tf.string if value["dtype"] == STRING else None
            args[key] = tf.constant(tensor_value(value), dtype=dtype)
        elif key == "dtype":
            args[key] = tf.as_dtype(value)
        elif key in ("element_shape", "element_shape_except0"):
            args[key] = tf.TensorShape(value)
        else:
            args[key] = value
    try:
        outputs = getattr(tf.raw_ops, step["op"])(**args)
    except tf.errors.OpError as e:
        return {"error": type(e).__name__, "message": e.message}
    outs = step.get("out", [])
    results = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    env.update(zip(outs, results))
    # TensorFlow's dtype names are the format's ("bfloat16", "string"); values by
    # ``trace_format.encode`` (for number types, ``tolist()``).
    if step["op"] == "TensorArrayConcatV3":
        value, lengths = outputs
        return {**result(value.numpy(), value.dtype.name), "lengths": encode(lengths.numpy())}
    if step["op"] in ("TensorArrayReadV3", "TensorArrayGatherV3", "TensorArraySizeV3"):
        return result(outputs.numpy(), outputs.dtype.name)
    return {"ok": True}


def worker() -> None:
    """Reads traces (one JSON list per line) on stdin; prints each step's expectation
    as it completes, so the parent knows how far a trace got if this process dies.
    A script that calls ``record`` must call this when run with ``--worker``."""
    import tensorflow as tf

    print("READY", flush=True)
    for line in sys.stdin:
        env: dict = {}
        for step in json.loads(line):
            expect = run_step(tf, step, env)
            print(json.dumps(expect), flush=True)
            if "error" in expect:
                break
        print("END", flush=True)


def _start_worker() -> subprocess.Popen:
    """The calling script again, as a worker; fails loudly if it cannot run TensorFlow
    (else every trace would look as if it had crashed TensorFlow)."""
    log = tempfile.TemporaryFile(mode="w+")  # TensorFlow's logs; a file never fills up
    proc = subprocess.Popen(
        [sys.executable, sys.argv[0], "--worker"], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=log, text=True,
    )  # fmt: skip
    if proc.stdout.readline().strip() != "READY":
        proc.kill()
        log.seek(0)
        raise RuntimeError(f"the TensorFlow worker did not start:\n{log.read()[-2000:]}")
    return proc


def record(traces: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each trace with every step's expectation, run in workers of the calling script."""
    recorded: dict[str, list[dict]] = {}
    proc = None
    for name, steps in traces.items():
        if proc is None:
            proc = _start_worker()
        proc.stdin.write(json.dumps(steps) + "\n")
        proc.stdin.flush()
        done = []
        for line in proc.stdout:
            if line.strip() == "END":
                break
            done.append({**steps[len(done)], "expect": json.loads(line)})
        else:  # the worker died inside this trace, at step len(done)
            done.append({**steps[len(done)], "expect": {"tf_crashed": True}})
            proc.wait()
            proc = None
        recorded[name] = done
    if proc is not None:
        proc.stdin.close()
        proc.wait()
    return recorded


def record_to(out, seed: int, traces: dict[str, list[dict]]) -> None:
    """Record ``traces`` (made from ``seed``) and write them to ``out`` (a path), with the
    TensorFlow version and seed: the same traces give the same bytes."""
    import tensorflow as tf

    recorded = record(traces)
    crashed = sum("tf_crashed" in t[-1]["expect"] for t in recorded.values())
    meta = {"recorded_with": f"tensorflow {tf.__version__}", "seed": seed, "traces": recorded}
    out.write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    print(f"{len(recorded)} traces ({crashed} crashed TensorFlow) written to {out}")
