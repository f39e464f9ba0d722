#!/usr/bin/python3
"""Measure llama-server for the llamacpp-tiny-cpu profile (docs/profiles.md).

Start the server first, e.g.
  llama-server -m /tmp/tiny.gguf --host 127.0.0.1 --port 8099 -t 1 -np 2 -c 16384 \
      --metrics --slot-save-path /tmp/slots
then: measure.py PID [URL] > log; it writes measurements.json in the current
folder. PID is the server's process id (its CPU time is recorded beside each
timing). Standard library only.
"""
import json, os, random, sys, threading, time, urllib.request

PID = int(sys.argv[1])
URL = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:8099"
TCK = os.sysconf("SC_CLK_TCK")
rng = random.Random(7)


def cpu():
    f = open(f"/proc/{PID}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TCK * 1000  # utime + stime, ms


def toks(n):
    return [rng.randrange(1000, 150000) for _ in range(n)]


def post(prompt, n_predict=1, slot=-1):
    body = json.dumps({"prompt": prompt, "n_predict": n_predict, "cache_prompt": True, "id_slot": slot,
                       "ignore_eos": True, "temperature": 0}).encode()
    req = urllib.request.Request(URL + "/completion", body, {"Content-Type": "application/json"})
    c0 = cpu()
    with urllib.request.urlopen(req, timeout=900) as r:
        d = json.load(r)
    d["_cpu"], d["_load"] = cpu() - c0, os.getloadavg()[0]
    return d


def erase(slot):
    req = urllib.request.Request(f"{URL}/slots/{slot}?action=erase", b"{}", {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()


out = []


def rec(kind, **kw):
    out.append(dict(kind=kind, **kw))
    print(json.dumps(out[-1]), flush=True)


for _ in range(200):
    try:
        urllib.request.urlopen(URL + "/health", timeout=2)
        break
    except Exception:
        time.sleep(0.5)
post(toks(32), slot=0)
erase(0)
for F in [0, 2048, 6000]:  # tokens held by the other slot
    for P in [64, 256, 512, 1024, 2048, 4096, 7000]:
        erase(0)
        erase(1)
        if F:
            post(toks(F), slot=0)
        base = toks(P)
        d = post(base, slot=1); t = d["timings"]
        rec("cold", F=F, P=P, n=t["prompt_n"], ms=t["prompt_ms"], cpu=d["_cpu"], load=d["_load"])
        ext = base + toks(256)
        d = post(ext, slot=1); t = d["timings"]
        rec("extend", F=F, P=P, k=256, n=t["prompt_n"], ms=t["prompt_ms"], cpu=d["_cpu"], load=d["_load"])
        ext2 = ext + toks(5)
        d = post(ext2, slot=1); t = d["timings"]
        rec("extend", F=F, P=P + 256, k=5, n=t["prompt_n"], ms=t["prompt_ms"], cpu=d["_cpu"], load=d["_load"])
        d = post(ext2, 48, slot=1); t = d["timings"]
        rec("decode", F=F, P=P + 261, n=t["predicted_n"], ms=t["predicted_ms"],
            per_token=t["predicted_per_token_ms"], cpu=d["_cpu"], load=d["_load"])
        if F:  # both slots decoding at once, from cached prompts
            fill = toks(F)
            erase(0)
            post(fill, slot=0)
            res = [None, None]
            c0 = cpu()

            def run(i, p):
                res[i] = post(p, 48, slot=i)
            th = [threading.Thread(target=run, args=(0, fill)), threading.Thread(target=run, args=(1, ext2))]
            for x in th:
                x.start()
            for x in th:
                x.join()
            for i, d in enumerate(res):
                t = d["timings"]
                rec("decode2", F=F, P=P + 261, slot=i, n=t["predicted_n"], ms=t["predicted_ms"],
                    per_token=t["predicted_per_token_ms"], load=d["_load"])
            rec("decode2cpu", F=F, P=P + 261, cpu=cpu() - c0)
json.dump(out, open("measurements.json", "w"), indent=1)
