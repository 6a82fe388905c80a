"""A language model's loss under mixed_bfloat16: peak memory and time of a training step, per loss.

    python benchmarks/decoder_loss.py                       # vocabularies 32k and 128k, 4 x 512 tokens
    python benchmarks/decoder_loss.py --vocab 32000 --repeats 3 --json decoder_loss.json
    python benchmarks/decoder_loss.py --quick               # tiny sizes: checks that it runs

The model is causal-LM shaped: token ids ``[batch, seq]`` -> ``Embedding(vocab, dim)`` ->
``Dense(dim, relu)`` -> output projection ``Dense(vocab)`` -> logits ``[batch, seq, vocab]``,
trained by SGD (no optimizer slots: the loss's memory is what differs). Configurations:

- ``keras``: plain Keras as its mixed-precision guide does it: ``mixed_bfloat16`` global
  policy, the output ``Dense(vocab, dtype="float32")``,
  ``keras.losses.SparseCategoricalCrossentropy(from_logits=True)``;
- ``tfmp``: ``tfmp.enable("mixed_bfloat16")`` and Keras's loss: tfmp's logits rule keeps the
  projection bfloat16 and casts its logits to float32; on a CPU, tfmp's cross-entropy reads the
  bfloat16 logits (`tfmp._src.float32.cross_entropy`: two passes, or fused with the projection
  where one step's logits exceed 1 GiB). Before that feature: ``tfmp_cast`` in older tables;
- ``chunked``: plain Keras, ``mixed_bfloat16``, the output ``Dense`` bfloat16 and
  ``tfmp.ChunkedSparseCategoricalCrossentropy(fuse_projection=False)``: no float32 tensor of
  the logits' size, bfloat16 logits whole;
- ``fused``: as ``chunked`` with the loss's default ``fuse_projection=True``: the loss computes
  the logits from the projection's input and kernel a chunk at a time, the full-size
  projection is pruned, no logits of full size in any dtype;
- ``tfmp_fused``: ``tfmp.enable("mixed_bfloat16")`` and the (fused) chunked loss (tfmp keeps
  the logits bfloat16, `tfmp._src.float32.logits`).

``--model gpt2`` trains keras-hub's ``GPT2CausalLM`` instead (built from a configuration:
`GPT2_LAYERS` blocks of width ``--dim``, `GPT2_HEADS` heads, no dropout, no metric; inputs
``token_ids`` and ``padding_mask``), the same in every configuration: its tied
``ReversibleEmbedding`` projects the logits in float32 under a mixed policy.

Each configuration runs in a fresh Python process (``--one``): one warm-up step (it traces
the step), ``--steps`` timed steps (``train_on_batch``; step time: their median), then one
memory step, its peak above the memory held before it: what a training step adds
(activations, logits, gradients, temporaries). Two ways to read it (``--memory``):

- ``allocator`` (the default where TensorFlow keeps the statistics): TensorFlow's CPU
  allocator's own count of the bytes its tensors hold
  (``tf.config.experimental.reset_memory_stats`` before the step, then
  ``get_memory_info``'s ``peak`` less its ``current`` before). TensorFlow keeps them where
  its oneDNN ops are on (their pool allocator, ``mkl_cpu_allocator.h``); its plain CPU
  allocator keeps none (TensorFlow 2.21: "Allocator stats not available for device
  'CPU:0'"), and there the child falls back to ``rss``. Exact and repeatable; it counts
  tensors only.
- ``rss``: the process's resident set. glibc is told to map every block of 128 KiB or more
  on its own (``mallopt(M_MMAP_THRESHOLD)``, so that a freed tensor leaves the resident set
  at once; by default glibc keeps freed blocks under its dynamic threshold, up to 32 MiB,
  and a step reuses the previous one's) and to give back what it holds free
  (``malloc_trim``); the child reads its resident set size, resets the kernel's high-water
  mark (``/proc/self/clear_refs``, Linux >= 4.0), runs the step and reads the high-water
  mark. Where oneDNN's ops are on, the children run with
  ``TF_ONEDNN_USE_SYSTEM_ALLOCATOR=1`` (TensorFlow's switch from oneDNN's pool, which keeps
  freed blocks, to malloc). It counts everything the process touches (thread arenas, oneDNN's
  caches), and scatters by tens of MiB between repeats of the same code.

Loss: each configuration's loss on the batch before training (the warm-up step's, as the
training step computes it, fused or not), against Keras's float32 loss on the same model's
logits cast to float32 (the relative difference); all configurations start from the same
weights (seeded).

Configurations alternate within each repeat (the order rotated each repeat); reported:
medians over repeats, and each configuration's memory and step time over ``keras``'s, the
median of the per-repeat ratios (paired).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's tfmp

CONFIGS = ("keras", "tfmp", "chunked", "fused", "tfmp_fused")
#: ``--model gpt2``: keras-hub GPT2CausalLM's blocks and heads.
GPT2_LAYERS, GPT2_HEADS = 2, 4
#: glibc's mmap threshold for the memory step: a freed tensor of 128 KiB or more leaves RSS at once.
MMAP_THRESHOLD = 128 * 1024
#: ``mallopt``'s parameter number for the mmap threshold (glibc's malloc.h).
M_MMAP_THRESHOLD = -3
_MIB = 2.0**20


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _exact_rss() -> None:
    """From now on, blocks of `MMAP_THRESHOLD` bytes or more are mapped on their own; free heap given back."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed: not glibc?")
    libc.malloc_trim(0)


def build(config: str, vocab: int, dim: int, seq: int, chunk_bytes: Optional[int] = None, model_kind: str = "lm"):
    """The model of `config` (`model_kind`: ``"lm"`` or ``"gpt2"``), compiled; the global policy and tfmp as they were after."""
    import keras
    import tfmp

    keras.utils.set_random_seed(0)
    if config in ("keras", "tfmp"):
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        sizes = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
        loss = tfmp.ChunkedSparseCategoricalCrossentropy(fuse_projection=config != "chunked", **sizes)
    scope = tfmp.policy_scope("mixed_bfloat16", verbose=False) if config.startswith("tfmp") else None
    before = keras.config.dtype_policy()
    if scope is None:
        keras.config.set_dtype_policy("mixed_bfloat16")
    else:
        scope.__enter__()
    try:
        model = _gpt2(vocab, dim, seq) if model_kind == "gpt2" else _lm(config, vocab, dim, seq)
        # no metric: keras-hub's default accuracy reads the logits, which makes them whole in every configuration
        extra = {"weighted_metrics": []} if model_kind == "gpt2" else {}
        model.compile(keras.optimizers.SGD(0.01), loss=loss, **extra)
    finally:
        if scope is None:
            keras.config.set_dtype_policy(before)
        else:
            scope.__exit__(None, None, None)
    return model, loss


def _lm(config: str, vocab: int, dim: int, seq: int):
    """Embedding -> Dense(relu) -> Dense(vocab); under ``keras`` the last Dense float32, as Keras's guide does it."""
    import keras

    ids = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim, name="embedding")(ids)
    x = keras.layers.Dense(dim, activation="relu", name="block")(x)
    out_dtype = "float32" if config == "keras" else None
    return keras.Model(ids, keras.layers.Dense(vocab, dtype=out_dtype, name="logits")(x))


def _gpt2(vocab: int, dim: int, seq: int):
    """keras-hub's ``GPT2CausalLM``: `GPT2_LAYERS` blocks of width `dim`, `GPT2_HEADS` heads, its tied embedding
    projecting the logits (in float32 under a mixed policy: its table is not autocast), in every configuration.
    Without dropout, so that the training step's loss compares with the float32 loss of the model's own logits."""
    from benchmarks import hub_models

    return hub_models.task_builder("GPT2Backbone", "GPT2CausalLM", vocab, GPT2_LAYERS, GPT2_HEADS, dim, seq,
                                   dropout=0.0)()


def _inputs(model_kind: str, ids):
    """The model's inputs for token ids ``[batch, seq]``."""
    import numpy as np

    return {"token_ids": ids, "padding_mask": np.ones(ids.shape, bool)} if model_kind == "gpt2" else ids


def _allocator_stats_kept() -> bool:
    """True where TensorFlow's CPU allocator keeps statistics (its oneDNN pool allocator does)."""
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")
    except (ValueError, tf.errors.OpError):
        return False
    return True


def one(config: str, vocab: int, batch: int, seq: int, dim: int, steps: int,
        chunk_bytes: Optional[int] = None, memory: str = "allocator", model_kind: str = "lm") -> Dict[str, Any]:
    """Measures one configuration in this process (a child); returns its JSON-able record. `memory`:
    ``"allocator"`` (TensorFlow's allocator statistics, where kept; else the resident set) or ``"rss"``."""
    import numpy as np
    import tensorflow as tf
    import keras
    import warnings

    warnings.simplefilter("ignore")  # 16 bits on a CPU without bfloat16 instructions: PerformanceWarning
    rng = np.random.default_rng(1)
    x = _inputs(model_kind, rng.integers(0, vocab, size=(batch, seq)).astype("int32"))
    y = rng.integers(0, vocab, size=(batch, seq)).astype("int32")
    model, loss = build(config, vocab, dim, seq, chunk_bytes, model_kind)
    step_loss = float(model.train_on_batch(x, y))  # traces the step; the loss before the update
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - start)
    method = memory if memory == "rss" or _allocator_stats_kept() else "rss"
    if method == "allocator":
        held = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.train_on_batch(x, y)
        step_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - held
    else:
        _exact_rss()
        held = _status("VmRSS")
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
        model.train_on_batch(x, y)
        step_peak = _status("VmHWM") - held
    # the loss before training, against Keras's float32 loss on the same logits cast to float32
    model2, _ = build(config, vocab, dim, seq, chunk_bytes, model_kind)
    logits = model2(x)
    value = step_loss
    reference = float(keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y, tf.cast(logits, tf.float32)))
    return {
        "config": config, "vocab": vocab, "tokens": batch * seq, "logits_dtype": logits.dtype.name,
        "memory": method, "step_peak_mib": step_peak / _MIB, "held_before_step_mib": held / _MIB,
        "step_ms": 1000 * statistics.median(times), "step_ms_all": [1000 * t for t in times],
        "loss": value, "keras_float32_loss": reference, "loss_relative_difference": abs(value - reference) / reference,
    }


def _child(config: str, vocab: int, args: argparse.Namespace) -> Dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--one", config, "--vocab", str(vocab),
               "--batch", str(args.batch), "--seq", str(args.seq), "--dim", str(args.dim), "--steps", str(args.steps),
               "--memory", args.memory, "--model", args.model]
    if args.chunk_bytes is not None:
        command += ["--chunk-bytes", str(args.chunk_bytes)]
    env = dict(os.environ)
    if args.memory == "rss":
        env["TF_ONEDNN_USE_SYSTEM_ALLOCATOR"] = "1"  # oneDNN's pool would hide freed memory from RSS
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"configuration {config} (vocab {vocab}) failed with exit status {done.returncode} "
                           f"(negative: the signal that ended it):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _paired(runs: List[Dict[str, Any]], key: str, config: str) -> float:
    """Median over repeats of `config`'s `key` over ``keras``'s in the same repeat (NaN without ``keras``)."""
    if any("keras" not in r for r in runs):
        return float("nan")
    return statistics.median(r[config][key] / r["keras"][key] for r in runs)


def _methods(results: Dict[str, Any]) -> List[str]:
    """How the children read a step's peak (``allocator``, ``rss``), as they recorded it."""
    return sorted({r.get("memory", "rss") for runs in results["vocabs"].values() for repeat in runs
                   for r in repeat.values()})


def markdown(results: Dict[str, Any]) -> str:
    """The results as a markdown table, one row per vocabulary and configuration."""
    lines = [f"CPU: {results['cpu']}, {results['cores']} cores; TensorFlow {results['tensorflow']}, "
             f"Keras {results['keras']}; model {results.get('model', 'lm')}; {results['tokens']} tokens ({results['batch']} x {results['seq']}), "
             f"dim {results['dim']}, chunk_bytes {results['chunk_bytes'] or 'default'}, {results['steps']} timed steps, {results['repeats']} repeat(s); "
             f"TF_ENABLE_ONEDNN_OPTS {results['onednn']}; step peak read by: {', '.join(_methods(results))}; "
             f"load average {results['load_start']} -> {results['load_end']}.", "",
             "| vocab | config | logits | step peak MiB | vs keras | step ms | vs keras | loss rel. diff vs float32 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for vocab, runs in results["vocabs"].items():
        for config in results["configs"]:
            med = {k: statistics.median(r[config][k] for r in runs)
                   for k in ("step_peak_mib", "step_ms", "loss_relative_difference")}
            lines.append(f"| {vocab} | {config} | {runs[0][config]['logits_dtype']} | {med['step_peak_mib']:,.0f} | "
                         f"{_paired(runs, 'step_peak_mib', config):.2f} | {med['step_ms']:,.0f} | "
                         f"{_paired(runs, 'step_ms', config):.2f} | {med['loss_relative_difference']:.1e} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs every configuration for every vocabulary, alternating, and prints the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per configuration (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--chunk-bytes", type=int, help="the chunked losses' chunk_bytes (default: theirs)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--onednn", choices=["default", "on", "off"], default="default",
                        help="TF_ENABLE_ONEDNN_OPTS in the children: 'on' (1), 'off' (0), or as inherited")
    parser.add_argument("--model", choices=["lm", "gpt2"], default="lm",
                        help="the causal-LM-shaped model, or keras-hub's GPT2CausalLM (keras-hub installed)")
    parser.add_argument("--memory", choices=["allocator", "rss"], default="allocator",
                        help="a step's peak from TensorFlow's allocator statistics (where kept, else RSS) or the resident set")
    parser.add_argument("--quick", action="store_true", help="vocabulary 2000, 2 x 64 tokens, dim 32, 1 step")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # child process: print JSON
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.batch, args.seq, args.dim, args.steps = [2000], 2, 64, 32, 1
    if args.one:
        print(json.dumps(one(args.one, args.vocab[0], args.batch, args.seq, args.dim, args.steps, args.chunk_bytes,
                             args.memory, args.model)))
        return {}
    import keras
    import tensorflow as tf

    from tfmp._src.policy.hardware import detect_device_facts

    if args.onednn != "default":
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1" if args.onednn == "on" else "0"  # the children's
    load_start = [round(v, 2) for v in os.getloadavg()]
    vocabs: Dict[str, List[Dict[str, Any]]] = {}
    for vocab in args.vocab:
        vocabs[str(vocab)] = []
        for repeat in range(args.repeats):
            order = args.configs[repeat % len(args.configs):] + args.configs[:repeat % len(args.configs)]
            runs = {config: _child(config, vocab, args) for config in order}
            vocabs[str(vocab)].append(runs)
            print(f"vocab {vocab} repeat {repeat}: " + ", ".join(
                f"{c} {r['step_peak_mib']:.0f} MiB {r['step_ms']:.0f} ms" for c, r in runs.items()),
                file=sys.stderr, flush=True)
    results = {
        "cpu": detect_device_facts().cpu_name, "cores": os.cpu_count(), "tensorflow": tf.__version__,
        "keras": keras.__version__, "model": args.model, "tokens": args.batch * args.seq, "batch": args.batch, "seq": args.seq,
        "dim": args.dim, "chunk_bytes": args.chunk_bytes, "steps": args.steps, "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"), "repeats": args.repeats, "configs": args.configs,
        "load_start": load_start, "load_end": [round(v, 2) for v in os.getloadavg()], "vocabs": vocabs,
    }
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
