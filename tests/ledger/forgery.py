"""A ledger file forged without the key: shared by the ledger and the privacy tests."""

import json

from tf_dpiter.ledger import ledger_file


def forge_count(d, count):
  """A copy of the ledger dict `d` with its first run's count set to `count` and the digest
  recomputed (no key: what anyone can do to an unkeyed file)."""
  d = json.loads(json.dumps(d))
  d["num_samples"] += count - d["runs"][0]["count"]
  d["runs"][0]["count"] = count
  return ledger_file.sign({k: v for k, v in d.items() if k != "hmac"})
