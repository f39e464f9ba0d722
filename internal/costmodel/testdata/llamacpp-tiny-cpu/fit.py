#!/usr/bin/python3
"""Fit the llamacpp-tiny-cpu profile to measurements.json (needs numpy).

Prefill is priced as the simulator prices it: in 2,048-token batches, each
c0 + new·n + new_seq·n·span, the span being every used KV cell after the
batch (the other slot's F tokens, this slot's cached prefix and the batch).
Decode: c0 + per_seq·sequences + per_context_token·span, once per step.
Least squares on relative error.
"""
import json, os, sys
import numpy as np

path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "measurements.json")
d = json.load(open(path))
NB = 2048


def batches(cached, new, other):
    done, out = 0, []
    while done < new:
        n = min(NB, new - done)
        done += n
        out.append((n, other + cached + done))
    return out


rows, ys = [], []
for r in d:
    if r["kind"] == "cold":
        b = batches(0, r["P"], r["F"])
    elif r["kind"] == "extend":
        b = batches(r["P"], r["k"], r["F"])
    else:
        continue
    x = np.zeros(3)
    for n, s in b:
        x += [1, n, n * s]
    rows.append(x)
    ys.append(r["ms"])
X, y = np.array(rows), np.array(ys)
c, *_ = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)
rel = (X @ c - y) / y
print("prefill c0 %.4g new %.4g new_seq %.5g  (%d points, mean |err| %.1f%%, max %.1f%%)"
      % (c[0], c[1], c[2], len(y), 100 * np.mean(np.abs(rel)), 100 * np.max(np.abs(rel))))

rows, ys = [], []
for r in d:
    if r["kind"] == "decode":  # the span grows by 48 tokens over the run: its middle
        rows.append([1, 1, r["F"] + r["P"] + 24]); ys.append(r["per_token"])
    if r["kind"] == "decode2" and r["slot"] == 1:
        rows.append([1, 2, r["F"] + r["P"] + 48]); ys.append(r["per_token"])
X, y = np.array(rows, float), np.array(ys)
c, *_ = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)
rel = (X @ c - y) / y
print("decode c0 %.4g per_seq %.4g per_context_token %.4g  (%d points, mean |err| %.1f%%, max %.1f%%)"
      % (c[0], c[1], c[2], len(y), 100 * np.mean(np.abs(rel)), 100 * np.max(np.abs(rel))))
