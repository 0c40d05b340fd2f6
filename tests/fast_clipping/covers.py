"""All-pairs covers of test grids: a default subset of a full grid of cases in which every
pair of values of every two axes that occurs in the grid occurs too; the rest of the grid runs
under the `slow` marker (`python -m pytest -m slow`), so that default and slow runs together
are the full grid (pairwise, or combinatorial, testing: Cohen, Dalal, Fredman, Patton, "The
AETG System: An Approach to Testing Based on Combinatorial Design", section 3)."""

import itertools

import pytest


def _pairs(case):
  return {(i, repr(case[i]), j, repr(case[j]))
          for i, j in itertools.combinations(range(len(case)), 2)}


def all_pairs(grid, first=()):
  """A subset of `grid` (tuples of one length) holding every pair of values of every two
  positions that some case of `grid` holds: the cases of `first` (a subset of `grid` that
  must run), then greedily the case covering most uncovered pairs (the first one in `grid`
  order among equals). Deterministic."""
  grid = list(grid)
  wanted = set().union(*map(_pairs, grid))
  chosen = list(first)
  for case in chosen:
    wanted -= _pairs(case)
  while wanted:
    best = max(grid, key=lambda c: len(_pairs(c) & wanted))
    wanted -= _pairs(best)
    chosen.append(best)
  return chosen


def assert_covers_pairs_of(cases, grid):
  """Every pair of values of every two positions that occurs in `grid` occurs in `cases`."""
  for i, j in itertools.combinations(range(len(grid[0])), 2):
    assert ({(repr(c[i]), repr(c[j])) for c in cases} ==
            {(repr(c[i]), repr(c[j])) for c in grid}), (i, j)


def slow_outside(grid, default, ids=None):
  """pytest.params of every case of `grid`, those not in `default` marked slow."""
  keep = {repr(c) for c in default}
  return [pytest.param(*c, marks=() if repr(c) in keep else pytest.mark.slow,
                       id=None if ids is None else ids(c)) for c in grid]


def _keys(case, groups):
  return {(g, tuple(repr(case[i]) for i in g)) for g in groups}


def cover(grid, groups, first=()):
  """A subset of `grid` holding, for each tuple of positions in `groups`, every combination of
  values at those positions that some case of `grid` holds (groups [(0,), (1, 2)]: each value
  of position 0 once, each pair of values of positions 1 and 2). all_pairs is the cover of
  every two positions; a group of one position is each-choice coverage (Ammann, Offutt,
  "Introduction to Software Testing", chapter "Input Space Partitioning", combination
  strategies). Greedy like all_pairs; deterministic."""
  grid = list(grid)
  wanted = set().union(*(_keys(c, groups) for c in grid))
  chosen = list(first)
  for case in chosen:
    wanted -= _keys(case, groups)
  while wanted:
    best = max(grid, key=lambda c: len(_keys(c, groups) & wanted))
    wanted -= _keys(best, groups)
    chosen.append(best)
  return chosen


def assert_covers(cases, grid, groups):
  """Every combination of values at each group of positions that occurs in `grid` occurs in
  `cases`."""
  assert set().union(*(_keys(c, groups) for c in cases)) == set().union(
      *(_keys(c, groups) for c in grid))
