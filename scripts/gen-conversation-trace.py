#!/usr/bin/env python3
"""Writes a synthetic Mooncake-format conversation trace to stdout.

Shaped like Mooncake's published conversation trace (12,031 requests,
prompts of ~12k tokens on average, multi-turn sessions whose every turn
extends the previous prompt): sessions start as a Poisson process, each
opens with one of a few shared system prompts and a long user document,
and every next turn appends the previous answer and a new question. Block
ids are 512-token blocks (--trace-block-tokens 512, Mooncake's).

    scripts/gen-conversation-trace.py --requests 12000 --seed 1 > conv.jsonl
    prefixlb sim --trace conv.jsonl --trace-format mooncake ...
"""
import argparse, json, random

ap = argparse.ArgumentParser()
ap.add_argument("--requests", type=int, default=12000)
ap.add_argument("--seed", type=int, default=1)
ap.add_argument("--systems", type=int, default=16, help="distinct shared system prompts")
ap.add_argument("--system-blocks", type=int, default=4, help="512-token blocks per system prompt")
ap.add_argument("--doc-blocks", type=int, nargs=2, default=(8, 40), help="first turn's document, min max blocks")
ap.add_argument("--turns", type=float, default=6.0, help="mean turns per session (geometric)")
ap.add_argument("--session-rate", type=float, default=0.5, help="sessions started per second")
ap.add_argument("--think", type=float, default=20.0, help="mean seconds between a session's turns")
a = ap.parse_args()
rng = random.Random(a.seed)
next_id = 0
def fresh(n):
    global next_id
    ids = list(range(next_id, next_id + n))
    next_id += n
    return ids
systems = [fresh(a.system_blocks) for _ in range(a.systems)]
events = []
t = 0.0
while len(events) < a.requests:
    t += rng.expovariate(a.session_rate)
    blocks = systems[rng.randrange(a.systems)] + fresh(rng.randint(*a.doc_blocks))
    turn_t = t
    while True:
        out = max(8, int(rng.expovariate(1 / 350)))
        events.append((turn_t, {"input_length": len(blocks) * 512, "output_length": out, "hash_ids": list(blocks)}))
        if rng.random() < 1 / a.turns or len(events) >= a.requests:
            break
        blocks = blocks + fresh(1 + (out + rng.randint(200, 1500)) // 512)
        turn_t += rng.expovariate(1 / a.think)
events.sort(key=lambda e: e[0])
for ts, e in events[: a.requests]:
    print(json.dumps({"timestamp": int(ts * 1000), **e}))
