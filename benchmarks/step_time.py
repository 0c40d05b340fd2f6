"""Step time and peak memory of non-private vs DP training steps (Keras 3, tf_dpiter).

  python benchmarks/step_time.py --model cnn --mode nonprivate --batch_size 256
  python benchmarks/step_time.py --model cnn --mode dp --clipping vectorized --batch_size 256
  python benchmarks/step_time.py --model mlp --mode dp --batch_size 1024 --max_physical_batch_size 256
  python benchmarks/step_time.py --model mlp --mode dp --clipping auto --secure_mode

Prints one JSON line: ms/step (median over --steps timed steps after --warmup steps),
peak memory (process peak RSS on CPU; peak GPU allocator bytes on a GPU) and the settings.
Each configuration runs in its own process, so runs can be made side by side:
  for m in nonprivate dp; do python benchmarks/step_time.py --model cnn --mode $m; done

The side-by-side table of issue 6 (non-private, fast clipping, two-pass, vectorized, all
timed round-robin in one process; CNN, MLP and Transformer) is
  python benchmarks/step_time.py --table [--no-jit] [--memory] [--models ...] [--modes ...]
which runs benchmarks/fast_clipping_step_time.py with the remaining arguments.
"""

import argparse
import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dpiter as dp  # noqa: E402


def make_model(kind, private):
  if kind == "cnn":   # TF Privacy's MNIST tutorial CNN
    layers = dp.keras.example_models.mnist_cnn_layers()
  else:               # 784-512-10 MLP
    layers = dp.keras.example_models.mlp_layers()
  return dp.keras.DPSequential(layers) if private else keras.Sequential(layers)


def peak_memory_bytes():
  if tf.config.list_physical_devices("GPU"):
    return int(tf.config.experimental.get_memory_info("GPU:0")["peak"]), "gpu_peak_allocated"
  return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "process_peak_rss"


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--table" in argv:
    import fast_clipping_step_time  # pylint: disable=g-import-not-at-top
    argv.remove("--table")
    sys.argv = [fast_clipping_step_time.__file__] + argv
    return fast_clipping_step_time.main()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
  p.add_argument("--mode", choices=["nonprivate", "dp"], default="dp")
  p.add_argument("--clipping", choices=["vectorized", "fast", "auto"], default="vectorized")
  p.add_argument("--batch_size", type=int, default=256)
  p.add_argument("--steps", type=int, default=20, help="timed steps")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--jit", action="store_true")
  p.add_argument("--max_physical_batch_size", type=int, default=None)
  p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TF default)")
  p.add_argument("--secure_mode", action="store_true",
                 help="DP optimizer with secure_mode=True (noise from os.urandom)")
  p.add_argument("--dtype_policy", default="float32",
                 help="keras dtype policy (float32, mixed_bfloat16, mixed_float16, bfloat16)")
  args = p.parse_args(argv)
  keras.config.set_dtype_policy(args.dtype_policy)
  if args.threads:
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)

  rng = np.random.RandomState(0)
  shape = (28, 28, 1) if args.model == "cnn" else (784,)
  x = tf.constant(rng.rand(args.batch_size, *shape).astype("float32"))
  y = tf.constant(rng.randint(0, 10, args.batch_size).astype("int32"))
  loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  private = args.mode == "dp"
  model = make_model(args.model, private)
  if private:
    extra = {"secure_mode": True} if args.secure_mode else {}
    opt = dp.keras.DPKerasSGDOptimizer(1.0, 1.1, learning_rate=0.15, clipping=args.clipping,
                                       max_physical_batch_size=args.max_physical_batch_size,
                                       **extra)
  else:
    opt = keras.optimizers.SGD(0.15)
  model.compile(optimizer=opt, loss=loss, jit_compile=args.jit)
  if private:
    opt.set_sampling(60000, args.batch_size / 60000, "shuffle", args.batch_size)
  rss_before = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
  times = []
  t_first = time.perf_counter()
  for i in range(args.warmup + args.steps):
    t = time.perf_counter()
    model.train_on_batch(x, y)
    if i >= args.warmup:
      times.append(time.perf_counter() - t)
    if i == 0:
      t_first = time.perf_counter() - t_first
  mem, mem_kind = peak_memory_bytes()
  out = {
      "model": args.model, "mode": args.mode, "batch_size": args.batch_size,
      "clipping": (opt.resolve_clipping(model) if private else None), "jit": args.jit,
      "secure_mode": args.secure_mode, "dtype_policy": args.dtype_policy,
      "max_physical_batch_size": args.max_physical_batch_size,
      "ms_per_step": round(1000 * float(np.median(times)), 2),
      "ms_per_step_p10": round(1000 * float(np.percentile(times, 10)), 2),
      "first_step_s": round(t_first, 2), "steps": args.steps,
      "peak_memory_mb": round(mem / 2**20, 1), "memory_kind": mem_kind,
      "rss_before_training_mb": round(rss_before / 2**20, 1),
      "device": "gpu" if tf.config.list_physical_devices("GPU") else f"cpu x{os.cpu_count()}",
      "ledger_steps": int(model.ledger.sample_count.numpy()) if private else None,
  }
  print(json.dumps(out))


if __name__ == "__main__":
  main()
