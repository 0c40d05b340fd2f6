"""TF Privacy's `movielens_tutorial.py` (a tf.estimator program with the TF1
`DPAdamGaussianOptimizer` and GDP accounting), rewritten for tf_dpiter and Keras 3 by the
migration guide's rows (docs/migration/tf-privacy.md).

What changed against TF Privacy's file, one row of the guide each:

* the Estimator program (`nn_model_fn`, a fresh `numpy_input_fn` for every Poisson sample drawn
  by hand, `classifier.train(steps=1)`) -> its layers (the neural collaborative filtering net:
  GMF and MLP embeddings of user and movie, 5 logits) as a functional `dp.keras.DPModel` with
  named inputs, trained by `model.fit(x, y, batch_size=B)`, which draws the Poisson samples
  itself (q = B / n, round(n / B) steps an epoch) and records each in the ledger;
* `dp_optimizer.DPAdamGaussianOptimizer(l2_norm_clip, noise_multiplier, num_microbatches,
  learning_rate)` -> `dp.keras.DPKerasAdamOptimizer`, the same arguments; TF Privacy set
  num_microbatches to the sample's size (one example per microbatch), here batch_size: the
  same per-example clipping, and `fit` keeps Poisson sampling;
* `compute_eps_poisson(epoch, noise_multiplier, n, batch_size, delta)` and
  `compute_mu_poisson(...)` -> the ledger: the RDP epsilon (an upper bound) by
  `model.privacy_statement(delta)`, and beside it the GDP epsilon and mu TF Privacy printed, by
  `dp.accounting.privacy_report(model.ledger, delta, accountant="gdp")`, labelled as the
  central limit theorem APPROXIMATION they are (not an upper bound: it can understate
  epsilon); TF Privacy's stop at `mu > max_mu` becomes `--max_epsilon`, a stop on the upper
  bound (`dp.keras.callbacks.StopAtPrivacyBudget`).

Data: MovieLens-1M's `ratings.dat` (`--ratings_path`, "user::movie::rating::time" lines, the
last 20% held out) when you have it; otherwise (the default: no download here) synthetic
ratings with MovieLens' structure: hidden movie qualities, user leniencies and 3-d tastes, a
rating in 1..5 their sum plus noise. Evaluation: RMSE of the expected rating under the
model's softmax, as TF Privacy's EVAL branch.

Privacy claim: (epsilon, delta)-DP for adding or removing ONE RATING (example level; a user
with many ratings is protected less, which needs user-level sampling), RDP accountant over the
ledger, n = len(training ratings) treated as public.

  python tutorials/movielens_dp.py --quick         # 2000 synthetic ratings, 1 epoch (seconds)
  python tutorials/movielens_dp.py                 # 40000 synthetic ratings, 20 epochs
  python tutorials/movielens_dp.py --ratings_path ml-1m/ratings.dat --batch_size 10000 --epochs 25

The last line printed is JSON: {"test_rmse", "test_accuracy", "epsilon", "epsilon_gdp", ...}
(accuracy: the most likely rating equals the true one).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (was: import tensorflow_privacy)

QUICK = dict(num_ratings=2000, epochs=1, batch_size=100)


def synthetic_ratings(num_users, num_movies, num_ratings, seed=0, dim=3, noise=0.4):
  """(users, movies, ratings): random (user, movie) pairs rated round(3 + b_movie + b_user +
  0.8 u.v + noise), clipped to 1..5: hidden movie qualities (sd 0.8), user leniencies
  (sd 0.5) and unit-variance tastes u, v of `dim` dimensions, as in real rating data where
  the biases explain much of the variance."""
  rng = np.random.RandomState(seed)
  b_movie, b_user = 0.8 * rng.randn(num_movies), 0.5 * rng.randn(num_users)
  u = rng.randn(num_users, dim) / np.sqrt(dim)
  v = rng.randn(num_movies, dim)
  users = rng.randint(0, num_users, num_ratings).astype("int32")
  movies = rng.randint(0, num_movies, num_ratings).astype("int32")
  score = (3.0 + b_movie[movies] + b_user[users] + 0.8 * np.sum(u[users] * v[movies], axis=1)
           + noise * rng.randn(num_ratings))
  return users, movies, np.clip(np.round(score), 1, 5).astype("int32")


def load_movielens(path, seed=100):
  """MovieLens-1M's ratings.dat ("user::movie::rating::time"): (users, movies, ratings) with
  dense 0-based ids, in a random order (seeded: the last 20% are the test split)."""
  rows = np.array([line.split("::")[:3] for line in open(path, encoding="latin-1")
                   if line.strip()], dtype=np.int64)
  _, users = np.unique(rows[:, 0], return_inverse=True)
  _, movies = np.unique(rows[:, 1], return_inverse=True)
  order = np.random.RandomState(seed).permutation(len(rows))
  return (users[order].astype("int32"), movies[order].astype("int32"),
          rows[order, 2].astype("int32"))


def nn_model(num_users, num_movies, latent_user=10, latent_movie=10, latent_mf=5):
  """TF Privacy's nn_model_fn (after He et al., "Neural Collaborative Filtering", 2017):
  generalized matrix factorization (element-wise product of user and movie embeddings) and
  an MLP part (their concatenation), joined into 5 logits, one per rating."""
  user = keras.Input((), dtype="int32", name="user")
  movie = keras.Input((), dtype="int32", name="movie")
  mf_vector = keras.layers.Multiply()([keras.layers.Embedding(num_users, latent_mf)(user),
                                       keras.layers.Embedding(num_movies, latent_mf)(movie)])
  mlp_vector = keras.layers.Concatenate()([keras.layers.Embedding(num_users, latent_user)(user),
                                           keras.layers.Embedding(num_movies,
                                                                  latent_movie)(movie)])
  logits = keras.layers.Dense(5)(keras.layers.Concatenate()([mf_vector, mlp_vector]))
  return dp.keras.DPModel({"user": user, "movie": movie}, logits)


def rmse_and_accuracy(model, x, ratings):
  """TF Privacy's EVAL metric (RMSE of the softmax's expected rating) and exact accuracy."""
  probs = keras.ops.convert_to_numpy(keras.ops.softmax(
      model.predict(x, batch_size=4096, verbose=0), axis=1))
  expected = probs @ np.arange(1, 6, dtype=np.float32)
  return (float(np.sqrt(np.mean((expected - ratings) ** 2))),
          float(np.mean(np.argmax(probs, axis=1) + 1 == ratings)))


def main(argv=None):
  """Runs the tutorial; returns (JSON summary dict, trained model)."""
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--ratings_path", default=None, help="MovieLens-1M ratings.dat (else synthetic)")
  p.add_argument("--quick", action="store_true", help="1 epoch on 2000 synthetic ratings")
  p.add_argument("--num_users", type=int, default=200, help="synthetic data")
  p.add_argument("--num_movies", type=int, default=100, help="synthetic data")
  p.add_argument("--num_ratings", type=int, default=40000, help="synthetic training ratings")
  p.add_argument("--batch_size", type=int, default=500,
                 help="expected batch size (Poisson); TF Privacy's sampling_batch is 10000")
  p.add_argument("--learning_rate", type=float, default=0.01)
  p.add_argument("--noise_multiplier", type=float, default=0.55)
  p.add_argument("--l2_norm_clip", type=float, default=5.0)
  p.add_argument("--epochs", type=int, default=20)
  p.add_argument("--max_epsilon", type=float, default=None,
                 help="stop before the RDP epsilon would pass it (TF Privacy: --max_mu)")
  p.add_argument("--delta", type=float, default=1e-6)
  p.add_argument("--verbose", type=int, default=0)
  args = p.parse_args(argv)
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  if args.ratings_path:
    users, movies, ratings = load_movielens(args.ratings_path)
    n = int(0.8 * len(ratings))
  else:
    n = args.num_ratings
    users, movies, ratings = synthetic_ratings(args.num_users, args.num_movies, n + n // 4)
  x_train = {"user": users[:n], "movie": movies[:n]}
  x_test = {"user": users[n:], "movie": movies[n:]}

  model = nn_model(int(users.max()) + 1, int(movies.max()) + 1)
  model.compile(
      optimizer=dp.keras.DPKerasAdamOptimizer(   # was: DPAdamGaussianOptimizer
          l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
          num_microbatches=args.batch_size, learning_rate=args.learning_rate),
      # the vector loss of nn_model_fn: softmax cross entropy per rating (labels 0..4)
      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None))
  callbacks = ([] if args.max_epsilon is None else
               [dp.keras.callbacks.StopAtPrivacyBudget(args.max_epsilon, args.delta)])
  start = time.time()
  for epoch in range(1, args.epochs + 1):
    model.fit(x_train, ratings[:n] - 1, batch_size=args.batch_size, epochs=1,
              verbose=args.verbose, callbacks=callbacks)
    if model.stop_training:
      break
    rmse, _ = rmse_and_accuracy(model, x_test, ratings[n:])
    print(f"Test RMSE after {epoch} epochs is: {rmse:.3f}")
    eps = model.privacy_statement(args.delta).epsilon   # was: compute_eps_poisson(...)
    gdp = dp.accounting.privacy_report(model.ledger, delta=args.delta, accountant="gdp")
    print(f"For delta={args.delta:g}, the current epsilon is: {eps:.2f} (RDP, an upper "
          f"bound; GDP, an approximation: {gdp.epsilon:.2f})")

  statement = model.privacy_statement(args.delta)
  gdp = dp.accounting.privacy_report(model.ledger, delta=args.delta, accountant="gdp")
  print(statement)
  print(gdp)   # was: compute_mu_poisson(...): mu is in its notes, labelled approximate
  rmse, accuracy = rmse_and_accuracy(model, x_test, ratings[n:])
  baseline = float(np.sqrt(np.mean((ratings[:n].mean() - ratings[n:]) ** 2)))
  out = {"test_rmse": rmse, "test_accuracy": accuracy, "baseline_rmse": baseline,
         "epsilon": statement.epsilon, "epsilon_gdp": gdp.epsilon, "delta": args.delta,
         "steps": statement.steps, "sampling": statement.policy,
         "relation": statement.relation, "unit": statement.unit,
         "q": statement.selection_probability, "noise_multiplier": args.noise_multiplier,
         "batch_size": args.batch_size, "train_size": n, "epochs": args.epochs,
         "seconds": round(time.time() - start, 1)}
  print(json.dumps(out))
  return out, model


if __name__ == "__main__":
  main()
