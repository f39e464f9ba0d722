"""Regenerates golden.json: the Qwen3 chat template rendered by Jinja2 the
way Hugging Face transformers' apply_chat_template (and so vLLM) renders it:
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True) with
loopcontrols, tojson = json.dumps(ensure_ascii=False), and vLLM's message
preprocessing (tool-call arguments decoded from JSON strings).

Run from this directory: python3 gen_golden.py  (needs only jinja2)."""
import json
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(msg):
    raise Exception(msg)


cfg = json.load(open("../../qwen3/tokenizer_config.json"))
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
tmpl = env.from_string(cfg["chat_template"])

out = {}
for case in json.load(open("cases.json")):
    msgs = []
    for m in case["messages"]:
        m = dict(m)
        for tc in m.get("tool_calls", []):
            tc.setdefault("type", "function")
            try:
                tc["function"]["arguments"] = json.loads(tc["function"]["arguments"])
            except ValueError:
                pass
        msgs.append(m)
    kw = dict(case.get("kwargs", {}))
    out[case["name"]] = tmpl.render(
        messages=msgs, tools=case.get("tools"), add_generation_prompt=case["add_generation_prompt"],
        bos_token=None, eos_token=cfg["eos_token"], pad_token=cfg["pad_token"], unk_token=None, **kw)
json.dump(out, open("golden.json", "w"), ensure_ascii=False, indent=1)
