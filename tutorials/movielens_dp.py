"""DP training of a rating model with user and movie embeddings (port of TF Privacy's
MovieLens tutorial, on synthetic ratings: no download).

TF Privacy's `movielens_tutorial.py` learns user and movie embeddings from MovieLens-1M
ratings with DP-Adam and reports RMSE with an epsilon from its GDP accountant. Here the
ratings are synthetic (movies have hidden qualities, users leniencies and 3-d tastes; a
rating in 1..5 is their sum plus noise), the model is a functional `dp.keras.DPModel` (two embeddings, an MLP
head), and `model.fit((users, movies), ratings, batch_size=B)` samples by Poisson
(q = B / n), so the ledger's Poisson accounting is true.

Privacy claim: example level, (epsilon, delta)-DP for adding or removing ONE RATING (a user
with many ratings is protected less: that needs user-level sampling, not this tutorial).
Epsilon comes from the ledger by the RDP accountant (dp-accounting, an upper bound); the GDP
number TF Privacy's tutorial prints is shown next to it for comparison: it is a central
limit theorem APPROXIMATION, not an upper bound, and can be smaller.

  python tutorials/movielens_dp.py --quick         # well under a minute on 2 cores
  python tutorials/movielens_dp.py --epochs 20

The last line printed is JSON: {"test_rmse", "test_accuracy", "epsilon", "epsilon_gdp", ...}
(accuracy: the rounded prediction equals the rating).
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpiter as dp  # noqa: E402  (pip install -e . : see README)


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
  return users, movies, np.clip(np.round(score), 1, 5).astype("float32")


def make_model(num_users, num_movies, dim=8):
  """User and movie embeddings, concatenated, dense 32 relu, one output (the rating)."""
  user = keras.Input((), dtype="int32", name="user")
  movie = keras.Input((), dtype="int32", name="movie")
  h = keras.layers.Concatenate()([keras.layers.Embedding(num_users, dim)(user),
                                  keras.layers.Embedding(num_movies, dim)(movie)])
  h = keras.layers.Dense(32, activation="relu")(h)
  # the output starts at 3, the middle of the public 1..5 scale (no data used)
  out = keras.layers.Dense(1, bias_initializer=keras.initializers.Constant(3.0))(h)
  return dp.keras.DPModel({"user": user, "movie": movie}, out)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--epochs", type=int, default=20)
  p.add_argument("--quick", action="store_true", help="2 epochs on 6000 ratings")
  p.add_argument("--num_users", type=int, default=200)
  p.add_argument("--num_movies", type=int, default=100)
  p.add_argument("--num_ratings", type=int, default=40000)
  p.add_argument("--batch_size", type=int, default=500, help="expected batch size (Poisson)")
  p.add_argument("--l2_norm_clip", type=float, default=5.0)
  p.add_argument("--noise_multiplier", type=float, default=0.8)
  p.add_argument("--learning_rate", type=float, default=0.01)
  p.add_argument("--delta", type=float, default=1e-5)
  p.add_argument("--verbose", type=int, default=2)
  args = p.parse_args(argv)
  if args.quick:
    args.epochs, args.num_ratings, args.batch_size = 2, 6000, 200
  users, movies, ratings = synthetic_ratings(args.num_users, args.num_movies,
                                             args.num_ratings + args.num_ratings // 5)
  n = args.num_ratings
  x_train = {"user": users[:n], "movie": movies[:n]}
  x_test = {"user": users[n:], "movie": movies[n:]}
  model = make_model(args.num_users, args.num_movies)
  model.compile(optimizer=dp.keras.DPKerasAdamOptimizer(
      l2_norm_clip=args.l2_norm_clip, noise_multiplier=args.noise_multiplier,
      learning_rate=args.learning_rate), loss="mse")
  start = time.time()
  model.fit(x_train, ratings[:n], batch_size=args.batch_size, epochs=args.epochs,
            verbose=args.verbose, callbacks=[dp.keras.PrivacyMeter(args.delta, verbose=1)])
  pred = model.predict(x_test, batch_size=2048, verbose=0)[:, 0]
  truth = ratings[n:]
  report = dp.accounting.privacy_report(model.ledger, delta=args.delta)
  gdp = dp.accounting.privacy_report(model.ledger, delta=args.delta, accountant="gdp")
  print(report)
  print(f"GDP accountant (TF Privacy's MovieLens number; an approximation, not an upper "
        f"bound): epsilon = {gdp.epsilon:.4g}")
  print(json.dumps({
      "test_rmse": float(np.sqrt(np.mean((pred - truth) ** 2))),
      "test_accuracy": float(np.mean(np.clip(np.round(pred), 1, 5) == truth)),
      "baseline_rmse": float(np.sqrt(np.mean((ratings[:n].mean() - truth) ** 2))),
      "epsilon": report.epsilon, "epsilon_gdp": gdp.epsilon, "delta": args.delta,
      "steps": int(model.ledger.sample_count.numpy()), "epochs": args.epochs,
      "seconds": round(time.time() - start, 1)}))


if __name__ == "__main__":
  main()
